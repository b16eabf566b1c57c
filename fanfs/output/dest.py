"""DEST, reached safely: the directory the user named, checked before every use; the bytes
of a local file copied to it and read back; what landed read back to the node; the replicas'
progress marker. apply.py applies one journal op to it with these.

DEST is the directory the user named. Before each op it is opened again by that path and
must be the directory that was mounted (device and inode): a DEST moved away, removed or
re-created since fails the op with a message that says so (LandingError), instead of landing
files in a directory the user no longer calls DEST.

Safety: every path is walked one component at a time with O_NOFOLLOW from the checked root
fd, so a symlink planted in DEST (by anyone) is never followed; files are created O_EXCL with
the writer's own rights (the daemon never changes identity), and modes are masked to the
permission bits (no set-uid file ever lands).

Concurrency: these functions run in worker threads (the lander's, a replica holder's, the
view's read-backs).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

CHUNK = 8 << 20  # copy and check in 8 MiB pieces: large enough for a shared file system's RPCs
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LandingError(Exception):
    """An op could not be applied to DEST (its message says which and why)."""


@dataclass(frozen=True, slots=True)
class Ident:
    """What fanfs landed at DEST for a file or directory: it is still that while all match."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    blocks: int

    @classmethod
    def of(cls, st: os.stat_result) -> Ident:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_blocks)

    def same_object(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)

    def same(self, st: os.stat_result) -> bool:
        return self.same_object(st) and (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns)

    def to_json(self) -> list[int]:
        return [self.dev, self.ino, self.size, self.mtime_ns, self.blocks]

    @classmethod
    def from_json(cls, v: object) -> Ident | None:
        if isinstance(v, list) and len(v) == 5 and all(isinstance(x, int) for x in v):
            return cls(*v)
        return None


class Outcome(enum.Enum):
    LANDED = "landed"
    GONE = "gone"  # a put whose local file is gone (its file was removed meanwhile)
    COND = "cond"  # a conditional put that would have replaced what fanfs did not land
    NOT_OURS = "not ours"  # a rename or removal of a name that holds something else now


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    ident: Ident | None = None  # what is at DEST for the op's node now (put, mkdir, attr)
    sent: int = 0  # bytes written to DEST
    appended: bool = False


class Dest:
    """DEST by the path the user gave, and the directory it was when the mount started."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self.dev, self.ino = st.st_dev, st.st_ino

    def root(self) -> int:
        """An fd of DEST, opened by its path now; LandingError if that is not the directory
        that was mounted. Symlinks in DEST's own path are the user's choice and followed."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise LandingError(f"DEST {self.path}: {e.strerror} (moved or removed since the "
                               "mount?); the files wait on this node") from None  # fmt: skip
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            os.close(fd)
            raise LandingError(f"DEST {self.path} is no longer the directory that was mounted "
                               "(moved or re-created since): not landing anything there; "
                               "the files wait on this node")  # fmt: skip
        return fd

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.path)


def _parts(path: bytes) -> list[bytes]:
    parts = [p for p in path.split(b"/") if p]
    if not parts or any(p in (b".", b"..") for p in parts):
        raise LandingError(f"{os.fsdecode(path)}: not a plain path")  # never from the kernel
    return parts


def open_parent(root_fd: int, path: bytes, create: bool) -> tuple[int, bytes]:
    """(an fd of the directory holding `path` under DEST, the last component): walked one
    component at a time, never through a symlink; missing directories made when `create`."""
    parts = _parts(path)
    fd = os.dup(root_fd)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)  # the user's umask applies
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
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


# -- bytes: copied by data segments, checked by reading them back --------------------------


def segments(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the data of `fd` in [start, end): holes are skipped where the file
    system can tell (SEEK_DATA, SEEK_HOLE), else it is all data."""
    off = start
    while off < end:
        try:
            data = os.lseek(fd, off, os.SEEK_DATA)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:
                return  # a hole up to the end of the file
            yield off, end - off  # EINVAL: not supported here
            return
        if data >= end:
            return
        hole = min(hole, end)
        yield data, hole - data
        off = hole


def copy_range(src: int, dst: int, start: int, end: int) -> tuple[int, int, list[tuple[int, int]]]:
    """Copy [start, end) of `src` to the same offsets of `dst`, data only: (bytes copied, their
    CRC-32, the segments). `dst` is then `end` bytes long."""
    crc, copied, segs = 0, 0, list(segments(src, start, end))
    for off, length in segs:
        done = 0
        while done < length:
            data = os.pread(src, min(CHUNK, length - done), off + done)
            if not data:
                raise LandingError(f"the local file ended at {off + done} bytes, below {end}")
            view = memoryview(data)
            pos = off + done
            while view:
                n = os.pwrite(dst, view, pos)
                view, pos = view[n:], pos + n
            crc = zlib.crc32(data, crc)
            done += len(data)
        copied += length
    if os.fstat(dst).st_size != end:
        os.ftruncate(dst, end)  # a hole at the end, or a shorter file (never: checked after)
    return copied, crc, segs


def read_back(fd: int, segs: list[tuple[int, int]]) -> int:
    """CRC-32 of `segs` of `fd`, read back (from storage where the kernel lets us)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    crc = 0
    for off, length in segs:
        done = 0
        while done < length:
            data = os.pread(fd, min(CHUNK, length - done), off + done)
            if not data:
                return -1
            crc = zlib.crc32(data, crc)
            done += len(data)
    return crc


# -- reading back what landed (a file evicted from the node's disk) --------------------------


def open_landed(dest: Dest, path: bytes, ident: Ident) -> int:
    """An fd of the file fanfs landed at `path`, for reading; LandingError if it is not there
    any more as fanfs left it (changed or moved at DEST by someone else)."""
    root = dest.root()
    try:
        fd, name = open_parent(root, path, create=False)
    except FileNotFoundError:
        raise LandingError(f"{os.fsdecode(path)}: not at DEST any more") from None
    finally:
        os.close(root)
    try:
        try:
            # O_NONBLOCK: a FIFO planted at the name does not hang the open.
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            out = os.open(name, flags, dir_fd=fd)
        except FileNotFoundError:
            raise LandingError(f"{os.fsdecode(path)}: not at DEST any more") from None
    finally:
        os.close(fd)
    if not ident.same(os.fstat(out)):
        os.close(out)
        raise LandingError(f"{os.fsdecode(path)}: changed at DEST since fanfs landed it")
    return out


def fetch(src: int, dst: int, ident: Ident) -> None:
    """What fanfs landed (`src`, from open_landed) back into a local file; LandingError if it
    changed while it was read."""
    copy_range(src, dst, 0, ident.size)
    if not ident.same(os.fstat(src)):
        raise LandingError("changed at DEST while it was read back")


# -- the replicas' progress marker ---------------------------------------------------------


def marker_name(token: str) -> str:
    """DEST's record of how far a daemon's journal has landed (replicas: a holder landing a
    dead owner's journal skips what the owner landed already)."""
    return f".fanfs-landed-{token}"


def write_marker(dest: Dest, token: str, seq: int) -> None:
    """Record in DEST that every op up to `seq` has landed (atomically: a rename)."""
    root = dest.root()
    try:
        name = marker_name(token)
        tmp = f"{name}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=root)  # fmt: skip
        try:
            os.write(fd, b"%d\n" % seq)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=root, dst_dir_fd=root)
    finally:
        os.close(root)


def read_marker(dest: Dest, token: str) -> int | None:
    """What `write_marker` recorded (None: nothing, or not a number)."""
    root = dest.root()
    try:
        fd = os.open(marker_name(token), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=root)  # fmt: skip
    except OSError:
        return None
    finally:
        os.close(root)
    try:
        text = os.read(fd, 32)
    finally:
        os.close(fd)
    return int(text) if text.strip().isdigit() else None


def remove_marker(dest: Dest, token: str) -> None:
    with contextlib.suppress(OSError, LandingError):
        root = dest.root()
        try:
            os.unlink(marker_name(token), dir_fd=root)
        finally:
            os.close(root)
