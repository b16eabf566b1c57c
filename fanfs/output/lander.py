"""The landing journal: every change made under an output mount, applied to DEST in order.

An output mount (`fanfs output`) keeps its files on the node's disk and lands them on DEST, a
directory on the shared file system, in the background. Each change the writer makes is one
`Op` in a journal, in the order it happened: `put` (a closed file's content, under the path it
had when it was closed), `rename`, `unlink`, `mkdir`, `rmdir`. One worker applies them to DEST
strictly in that order, so DEST goes through the same states as the mount did, at the
granularity of closed files.

What a reader of DEST sees:
- A file appears under its name only complete and checked: its bytes are copied to a hidden
  temporary name in the same directory (`.fanfs-<pid>-<seq>.partial`), synced, read back and
  compared (size and CRC-32 of what was copied), then renamed over the name. A half-written
  checkpoint is never under its final name, and a rename at DEST is atomic as at the mount.
- A rename or unlink in the mount is the same operation at DEST, after the puts before it.

Every op is idempotent against DEST's state, so applying one twice (a retry, or a replica
holder landing a dead node's journal, replicas.py) ends in the same place: a put whose local
file is gone since (unlinked) is skipped (the unlink follows), a rename whose source is not at
DEST is skipped, an unlink or rmdir of nothing is done.

Failures: an op that fails (DEST unwritable, full, gone) stays at the head of the journal and
is retried with backoff, for ever; nothing behind it is applied out of order, nothing is
dropped. Its error and attempts are in `statistics()` (`fanfs status`), `fanfs sync` and
`fanfs umount` report it and the files still pending, and a later retry (after the fault is
fixed) completes the journal.

Safety: DEST is reached through a directory fd opened once; every path is walked one component
at a time with O_NOFOLLOW, so a symlink planted in DEST (by anyone) is never followed; files are
created O_EXCL with the writer's own rights (the daemon never changes identity), and modes are
masked to the permission bits (no set-uid file ever lands).

Concurrency: the journal lives in the trio thread (`enqueue`, `run`); each op's I/O runs in a
worker thread (`trio.to_thread`), so a slow or hung DEST never blocks the mount's requests.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # copy and check in 8 MiB pieces: large enough for a shared file system's RPCs
RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0  # backoff of a failing op: quick at first, then patient
PUT, RENAME, UNLINK, MKDIR, RMDIR = "put", "rename", "unlink", "mkdir", "rmdir"


@dataclass(slots=True)
class Op:
    """One change to apply to DEST. `path` (and `new` for a rename) are relative to DEST, as
    bytes, components separated by b"/"; `ino` names a put's local file."""

    seq: int
    kind: str
    path: bytes
    new: bytes = b""
    ino: int = 0
    mode: int = 0o644
    size: int = 0  # a put's size when it was enqueued (the backlog's bytes)
    queued: float = field(default_factory=time.monotonic)
    attempts: int = 0
    error: str = ""

    def failed(self, error: str) -> None:
        self.attempts += 1
        self.error = error

    def describe(self) -> str:
        path = os.fsdecode(self.path)
        return f"{path} -> {os.fsdecode(self.new)}" if self.kind == RENAME else path

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "path": os.fsdecode(self.path),
                "new": os.fsdecode(self.new), "ino": self.ino, "mode": self.mode,
                "size": self.size}  # fmt: skip


class LandingError(Exception):
    """An op could not be applied to DEST (its message says which and why)."""


# -- DEST, reached safely ----------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(path: bytes) -> list[bytes]:
    parts = [p for p in path.split(b"/") if p]
    if any(p in (b".", b"..") for p in parts):
        raise LandingError(f"{os.fsdecode(path)}: not a plain path")  # never from the kernel
    return parts


def open_parent(root_fd: int, path: bytes, create: bool) -> tuple[int, bytes]:
    """(an fd of the directory holding `path` under DEST, the last component): walked one
    component at a time, never through a symlink; missing directories made when `create`."""
    parts = _parts(path)
    if not parts:
        raise LandingError("the root itself")
    fd = os.dup(root_fd)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)  # the user's umask applies
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LandingError(
                f"{os.fsdecode(path)}: a parent at DEST is not a directory (or is a symlink, "
                "which fanfs never follows)"
            ) from None
        raise
    return fd, parts[-1]


def copy_checked(src: int, dst: int) -> tuple[int, int]:
    """Copy all of `src` to `dst` (both fds, from offset 0): (bytes, CRC-32 of them)."""
    crc, off = 0, 0
    while True:
        data = os.pread(src, CHUNK, off)
        if not data:
            return off, crc
        view = memoryview(data)
        while view:
            n = os.pwrite(dst, view, off)
            view, off = view[n:], off + n
        crc = zlib.crc32(data, crc)


def _version(fd: int) -> tuple[int, int, int]:
    """What changes when a file is written: size, mtime, ctime (fine-grained on this kernel)."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_crc(fd: int) -> tuple[int, int]:
    """(size, CRC-32) of what `fd` holds, read back (from storage where the kernel lets us)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    crc, off = 0, 0
    while data := os.pread(fd, CHUNK, off):
        crc = zlib.crc32(data, crc)
        off += len(data)
    return off, crc


def apply(root_fd: int, op: Op, open_local: Callable[[int], int | None], token: str) -> int:
    """Apply `op` to DEST (in a worker thread); the bytes it landed. OSError or LandingError
    when it could not: DEST is then as before, but for a hidden partial file at worst. `token`
    names this daemon in temporary names (nodes share DEST, and pids repeat across nodes)."""
    if op.kind == PUT:
        return _put(root_fd, op, open_local, token)
    if op.kind == MKDIR:
        fd, name = open_parent(root_fd, op.path, create=True)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=fd)
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if not stat.S_ISDIR(mode):
                what = (
                    "a symlink (fanfs never follows one)"
                    if stat.S_ISLNK(mode)
                    else "not a directory"
                )
                raise LandingError(f"{os.fsdecode(op.path)}: at DEST and {what}")
        finally:
            os.close(fd)
        return 0
    try:
        fd, name = open_parent(root_fd, op.path, create=False)
    except FileNotFoundError:
        return 0  # its directory is not at DEST: nothing to rename or remove
    try:
        if op.kind == RENAME:
            newfd, newname = open_parent(root_fd, op.new, create=True)
            try:
                os.rename(name, newname, src_dir_fd=fd, dst_dir_fd=newfd)
                os.fsync(newfd)
            except FileNotFoundError:
                pass  # its source never landed (or is gone): the ops that follow say the rest
            finally:
                os.close(newfd)
        elif op.kind == UNLINK:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        elif op.kind == RMDIR:
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.ENOTEMPTY:
                    raise
                # Something that never came through the mount is in it: leave it be.
                log.warning("%s: not removed at DEST, it holds files fanfs did not write",
                            os.fsdecode(op.path))  # fmt: skip
        else:
            raise LandingError(f"unknown op {op.kind!r}")
    finally:
        os.close(fd)
    return 0


def _put(root_fd: int, op: Op, open_local: Callable[[int], int | None], token: str) -> int:
    src = open_local(op.ino)
    if src is None:
        return 0  # unlinked since: nothing to land (the unlink is further down the journal)
    try:
        fd, name = open_parent(root_fd, op.path, create=True)
        tmp = f".fanfs-{token}-{op.seq}.partial"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=fd)  # an earlier attempt's
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            out = os.open(tmp, flags, 0o600, dir_fd=fd)
            try:
                before = _version(src)
                size, crc = copy_checked(src, out)
                os.fsync(out)
                back = read_crc(out)
                if back != (size, crc):
                    raise LandingError(f"{os.fsdecode(op.path)}: read back {back[0]} bytes "
                                       f"(crc {back[1]:08x}) at DEST, wrote {size} (crc "
                                       f"{crc:08x})")  # fmt: skip
                if _version(src) != before:
                    # Written meanwhile (through a handle opened before the close that
                    # enqueued this put): not what was closed. The close after that write
                    # enqueues the next put; DEST keeps what it has until then.
                    log.info("%s changed while it was copied: left to its next close",
                             os.fsdecode(op.path))  # fmt: skip
                    os.close(out)
                    out = -1
                    os.unlink(tmp, dir_fd=fd)
                    return 0
                os.fchmod(out, op.mode & 0o777)
                st = os.fstat(src)
                os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                if out >= 0:
                    os.close(out)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(src)
    return size


def open_dest_dir(dest: str) -> int:
    """DEST's directory fd. Symlinks in DEST's own path are the user's choice and followed;
    inside DEST none is (open_parent)."""
    return os.open(os.path.realpath(dest), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def marker_name(token: str) -> str:
    """DEST's record of how far a daemon's journal has landed (replicas: a holder landing a
    dead owner's journal skips what the owner landed already)."""
    return f".fanfs-landed-{token}"


def write_marker(root_fd: int, token: str, seq: int) -> None:
    """Record in DEST that every op up to `seq` has landed (atomically: a rename)."""
    name = marker_name(token)
    tmp = f"{name}.partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=root_fd)  # fmt: skip
    try:
        os.write(fd, b"%d\n" % seq)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)


def read_marker(root_fd: int, token: str) -> int:
    """What `write_marker` recorded (0: nothing, or not a number)."""
    try:
        fd = os.open(marker_name(token), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=root_fd)  # fmt: skip
    except OSError:
        return 0
    try:
        text = os.read(fd, 32)
    finally:
        os.close(fd)
    return int(text) if text.strip().isdigit() else 0


def remove_marker(root_fd: int, token: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(marker_name(token), dir_fd=root_fd)


# -- the journal -------------------------------------------------------------------------------


class Lander:
    """The journal of one output mount and the task that lands it on DEST."""

    def __init__(self, dest_fd: int, open_local: Callable[[int], int | None], token: str,
                 max_ops: int = 1 << 20, on_enqueued: Callable[[Op], None] = lambda op: None,
                 on_landed: Callable[[Op], None] = lambda op: None,
                 marker: bool = False):  # fmt: skip
        self.dest_fd = dest_fd
        self._open_local = open_local
        self.max_ops = max_ops  # ops held at most (memory): more fail with ENOSPC
        self.journal: deque[Op] = deque()
        self.enqueued = 0  # seq of the last op enqueued
        self.landed = 0  # every op with seq <= landed is at DEST
        self.pending_bytes = 0
        self.landed_bytes = 0
        self.landed_files = 0
        self.busy_s = 0.0  # time spent landing (throughput = landed_bytes / busy_s)
        self.last_put_s = 0.0  # enqueue to landed, for the last put
        self.token = token
        self.marker = marker  # record progress at DEST after each op (write_marker)
        self.on_enqueued = on_enqueued  # replicas.py hears of each op, in order
        self.on_landed = on_landed  # and of each op landed; the tree frees a put's data
        self._changed = trio.Event()  # something enqueued, landed or failed
        self._poke = trio.Event()  # retry now (a sync or an umount asks)
        self._backoff_from = 0  # attempts of the head op when a retry was last asked for

    def full(self) -> bool:
        return len(self.journal) >= self.max_ops

    def enqueue(self, kind: str, path: bytes, new: bytes = b"", ino: int = 0, mode: int = 0,
                size: int = 0) -> Op:  # fmt: skip
        self.enqueued += 1
        op = Op(self.enqueued, kind, path, new, ino, mode, size)
        self.journal.append(op)
        self.pending_bytes += size
        self.on_enqueued(op)
        self._wake()
        return op

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def poke(self) -> None:
        """Retry a failing op now instead of after its backoff, and back off from the start
        again (someone thinks DEST works now)."""
        self._backoff_from = self.journal[0].attempts if self.journal else 0
        self._poke.set()

    async def wait_landed(self, seq: int, give_up_after_failures: int = 0) -> None:
        """Until every op up to `seq` is at DEST. LandingError once the op at the head has
        failed `give_up_after_failures` times (0: wait for ever)."""
        while self.landed < seq:
            head = self.journal[0] if self.journal else None
            if give_up_after_failures and head is not None and \
                    head.attempts >= give_up_after_failures:  # fmt: skip
                raise LandingError(f"{head.describe()}: {head.error}")
            await self._changed.wait()

    async def run(self) -> None:
        """Land the journal, in order, for ever (cancelled by the daemon at the end)."""
        if self.marker:  # from the start: a missing marker means "unknown", not "nothing"
            with contextlib.suppress(OSError):
                await trio.to_thread.run_sync(write_marker, self.dest_fd, self.token, 0)
        while True:
            while not self.journal:
                await self._changed.wait()
            op = self.journal[0]
            began = time.monotonic()
            try:
                n = await trio.to_thread.run_sync(self._apply, op, abandon_on_cancel=True)
            except (OSError, LandingError) as e:
                op.failed(os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e))
                log.warning("%s %s at DEST failed (attempt %d): %s", op.kind, op.describe(),
                            op.attempts, op.error)  # fmt: skip
                self._wake()
                self._poke = trio.Event()
                tries = max(0, op.attempts - self._backoff_from - 1)
                with trio.move_on_after(min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(tries, 16))):
                    await self._poke.wait()
                continue
            self.busy_s += time.monotonic() - began
            self.journal.popleft()
            self.pending_bytes -= op.size
            self.landed = op.seq
            if op.kind == PUT and n:
                self.landed_bytes += n
            if op.kind == PUT:
                self.landed_files += 1
                self.last_put_s = time.monotonic() - op.queued
            if op.attempts:
                log.info("%s %s landed after %d failed attempts", op.kind, op.describe(),
                         op.attempts)  # fmt: skip
            self.on_landed(op)
            self._wake()

    def _apply(self, op: Op) -> int:
        n = apply(self.dest_fd, op, self._open_local, self.token)
        if self.marker:
            write_marker(self.dest_fd, self.token, op.seq)
        return n

    def forget_marker(self) -> None:
        """Remove this daemon's marker from DEST (its partner, which would, is gone)."""
        if self.marker:
            remove_marker(self.dest_fd, self.token)

    def pending_files(self) -> list[str]:
        """The paths of the puts not at DEST yet, oldest first (each once)."""
        seen: dict[str, None] = {}
        for op in self.journal:
            if op.kind == PUT:
                seen.setdefault(os.fsdecode(op.path), None)
        return list(seen)

    def statistics(self) -> dict[str, Any]:
        head = self.journal[0] if self.journal else None
        now = time.monotonic()
        return {
            "enqueued": self.enqueued,
            "landed": self.landed,
            "backlog_ops": len(self.journal),
            "backlog_files": sum(1 for op in self.journal if op.kind == PUT),
            "backlog_bytes": self.pending_bytes,
            "oldest_s": round(now - head.queued, 3) if head is not None else 0.0,
            "landed_files": self.landed_files,
            "landed_bytes": self.landed_bytes,
            "throughput_mb_s": round(self.landed_bytes / self.busy_s / 1e6, 1)
            if self.busy_s > 0 else 0.0,
            "last_put_s": round(self.last_put_s, 3),
            "failing": None if head is None or not head.attempts else {
                "op": head.kind, "path": head.describe(), "attempts": head.attempts,
                "error": head.error,
            },
            "pending": self.pending_files()[:20],
        }  # fmt: skip
