"""DEST, reached safely: the journal's records (`Op`) and applying one to DEST.

What a reader of DEST sees:
- A file appears under its name only complete and checked: its bytes are copied to a hidden
  temporary name in the same directory (`.fanfs-<token>-<seq>.partial`), synced, read back and
  compared (size and CRC-32 of what was copied), then renamed over the name. A half-written
  checkpoint is never under its final name, and a rename at DEST is atomic as at the mount. A
  put whose local bytes change while they are copied is not landed (the next close is).
- A rename or unlink in the mount is the same operation at DEST.

Every op is idempotent against DEST's state, so applying one twice (a retry, or a replica
holder landing a dead node's journal, replicas.py) ends in the same place: a put whose local
file is gone since (unlinked) is skipped (the unlink follows), a rename whose source is not at
DEST is skipped, an unlink or rmdir of nothing is done. A sequence is not: the marker records
how far a daemon's journal has landed, for its replica holder.

Safety: DEST is reached through a directory fd opened once; every path is walked one component
at a time with O_NOFOLLOW, so a symlink planted in DEST (by anyone) is never followed; files are
created O_EXCL with the writer's own rights (the daemon never changes identity), and modes are
masked to the permission bits (no set-uid file ever lands).

Concurrency: these functions run in worker threads (the lander's, the replica holder's); an
`Op` is not changed once enqueued but for its attempts (the trio thread's).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # copy and check in 8 MiB pieces: large enough for a shared file system's RPCs
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
