"""DEST, reached safely: applying one journal op (journal.py) to it, in a worker thread.

DEST is the directory the user named. Before each op it is opened again by that path and
must be the directory that was mounted (device and inode): a DEST moved away, removed or
re-created since fails the op with a message that says so (LandingError), instead of landing
files in a directory the user no longer calls DEST.

What a reader of DEST sees:
- A file appears under its name complete and checked: its bytes are copied to a hidden name
  in the same directory (`.fanfs-<token>-<seq>.partial`), synced, read back and compared
  (size and CRC-32 of what was copied), given its mode and mtime, then renamed over the name.
  Holes stay holes (SEEK_DATA/SEEK_HOLE): `truncate -s 1G` lands a sparse file.
- A file that grew since its last landing, and whose earlier bytes did not change (a log),
  gets only its new bytes, appended in place (synced, read back), when DEST's file is still
  exactly what fanfs landed (device, inode, size, mtime): DEST bytes per byte written stay
  near 1 for a log closed after every line, instead of growing with the square of its size.
- A rename, an unlink, an rmdir, an attr touch only what fanfs itself landed for that file
  or directory (`expect`: its device and inode at DEST; `strict`): a name at DEST that holds
  something else (an earlier run's file, something put there by hand) is left alone. A
  directory made in the mount where DEST has one already becomes that one (files land into
  it; renaming it renames DEST's, with what it holds; an rmdir leaves it if it is not empty).
  Applied twice (a retry, a replay after a death: recover.py, replicas.py), an op ends in the
  same place.
- A conditional put (`Op.cond`: a file still open, landed on the way) lands only as a new
  file or as an append to fanfs's own earlier landing: it never replaces a version it did not
  write (`Outcome.COND`).

Safety: every path is walked one component at a time with O_NOFOLLOW from the checked root
fd, so a symlink planted in DEST (by anyone) is never followed; files are created O_EXCL with
the writer's own rights (the daemon never changes identity), and modes are masked to the
permission bits (no set-uid file ever lands).

Concurrency: these functions run in worker threads (the lander's, a replica holder's); an
`Op` is not changed while it is applied (journal.py: `busy`).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fanfs.output.journal import ATTR, MKDIR, PUT, RENAME, RMDIR, UNLINK, Op

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # copy and check in 8 MiB pieces: large enough for a shared file system's RPCs
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def _lstat(dir_fd: int, name: bytes) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


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


def _finish(fd: int, op: Op, segs: list[tuple[int, int]], crc: int) -> None:
    """Sync, check what was written, then give it its mode and mtime."""
    os.fsync(fd)
    if read_back(fd, segs) != crc or os.fstat(fd).st_size != op.size:
        raise LandingError(f"{os.fsdecode(op.path)}: read back at DEST differs from what was "
                           "written")  # fmt: skip
    if op.mode >= 0:
        os.fchmod(fd, op.mode & 0o777)
    if op.mtime_ns >= 0:
        os.utime(fd, ns=(op.mtime_ns, op.mtime_ns))


# -- applying one op -----------------------------------------------------------------------


def apply(dest: Dest, op: Op, source: Callable[[int], int | None], token: str,
          expect: Ident | None, strict: bool = True, replaced: Ident | None = None,
          ) -> Result:  # fmt: skip
    """Apply `op` to DEST (in a worker thread). `source` opens a put's local file (None once
    gone); `token` names this daemon in temporary names (nodes share DEST, pids repeat across
    nodes); `expect` is what fanfs landed for the op's node (None: nothing), `replaced` for
    the node a rename replaced. `strict`: rename and remove only what `expect` names (a
    replica holder, which knows no idents, is not). OSError or LandingError when it could not:
    DEST is then as before, but for a hidden partial file at worst (or a longer file, after a
    failed append)."""
    root = dest.root()
    try:
        if op.kind == PUT:
            return _put(root, op, source, token, expect)
        if op.kind == MKDIR:
            return _mkdir(root, op)
        try:
            fd, name = open_parent(root, op.path, create=False)
        except FileNotFoundError:
            fd, name = -1, b""  # its directory is not at DEST: nothing there
        try:
            st = _lstat(fd, name) if fd >= 0 else None
            if st is None or (strict and (expect is None or not expect.same_object(st))):
                if op.kind == RENAME and replaced is not None:
                    _remove_replaced(root, op, replaced)  # gone in the mount: gone at DEST
                return Result(Outcome.NOT_OURS)
            if op.kind == RENAME:
                _rename(root, fd, name, op)
            elif op.kind == UNLINK:
                if stat.S_ISDIR(st.st_mode):
                    return Result(Outcome.NOT_OURS)
                os.unlink(name, dir_fd=fd)
            elif op.kind == RMDIR:
                _rmdir(fd, name, op)
            elif op.kind == ATTR:
                ident = _attr(fd, name, op, expect if strict else None)
                return Result(Outcome.LANDED if ident else Outcome.NOT_OURS, ident)
            else:
                raise LandingError(f"unknown op {op.kind!r}")
        finally:
            if fd >= 0:
                os.close(fd)
    finally:
        os.close(root)
    return Result(Outcome.LANDED)


def _remove_replaced(root: int, op: Op, replaced: Ident) -> None:
    """A rename whose source never landed replaced, in the mount, something that did: that
    goes at DEST too (what the rename would have done)."""
    try:
        fd, name = open_parent(root, op.new, create=False)
    except FileNotFoundError:
        return
    try:
        st = _lstat(fd, name)
        if st is not None and replaced.same_object(st):
            if stat.S_ISDIR(st.st_mode):
                _rmdir(fd, name, op)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _rename(root: int, fd: int, name: bytes, op: Op) -> None:
    newfd, newname = open_parent(root, op.new, create=True)
    try:
        try:
            os.rename(name, newname, src_dir_fd=fd, dst_dir_fd=newfd)
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise LandingError(f"{op.describe()}: {os.fsdecode(op.new)} at DEST is in the "
                                   f"way ({e.strerror})") from None  # fmt: skip
            raise
        os.fsync(newfd)
    finally:
        os.close(newfd)


def _rmdir(fd: int, name: bytes, op: Op) -> None:
    try:
        os.rmdir(name, dir_fd=fd)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        # Something that never came through the mount is in it: leave it be.
        log.warning("%s: not removed at DEST, it holds files fanfs did not write",
                    os.fsdecode(op.path))  # fmt: skip


def _mkdir(root: int, op: Op) -> Result:
    fd, name = open_parent(root, op.path, create=True)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=fd)  # its mode follows, exactly (no umask)
        try:
            d = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = _lstat(fd, name)
            link = st is not None and stat.S_ISLNK(st.st_mode)
            what = "a symlink (fanfs never follows one)" if link else "not a directory"
            raise LandingError(f"{os.fsdecode(op.path)}: at DEST and {what}") from None
        try:
            if op.mode >= 0:
                os.fchmod(d, op.mode & 0o777)
            return Result(Outcome.LANDED, Ident.of(os.fstat(d)))
        finally:
            os.close(d)
    finally:
        os.close(fd)


def _attr(fd: int, name: bytes, op: Op, expect: Ident | None) -> Ident | None:
    """A mode or an mtime, set through an O_PATH fd (which needs no read permission); None
    if the name holds something else by then (`expect`), or a symlink."""
    p = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    try:
        st = os.fstat(p)
        if stat.S_ISLNK(st.st_mode) or (expect is not None and not expect.same_object(st)):
            return None
        via = f"/proc/self/fd/{p}"
        if op.mode >= 0:
            os.chmod(via, op.mode & 0o777)
        if op.mtime_ns >= 0:
            os.utime(via, ns=(op.mtime_ns, op.mtime_ns))
        return Ident.of(os.fstat(p))
    finally:
        os.close(p)


def _put(root: int, op: Op, source: Callable[[int], int | None], token: str,
         expect: Ident | None) -> Result:  # fmt: skip
    src = source(op.data)
    if src is None:
        return Result(Outcome.GONE)  # its file was removed meanwhile: the removal follows
    try:
        fd, name = open_parent(root, op.path, create=True)
        try:
            st = _lstat(fd, name)
            if expect is not None and op.keep >= expect.size and op.size >= expect.size and \
                    st is not None and stat.S_ISREG(st.st_mode) and expect.same(st):  # fmt: skip
                result = _append(fd, name, src, op, expect)
                if result is not None:
                    return result
            if op.cond and st is not None:
                return Result(Outcome.COND)  # it would replace what fanfs did not land
            return _replace(fd, name, src, op, token)
        finally:
            os.close(fd)
    finally:
        os.close(src)


def _append(fd: int, name: bytes, src: int, op: Op, expect: Ident) -> Result | None:
    """The new bytes of a file that only grew, added in place; None if DEST's file changed
    since it was looked at, or may not be opened for writing (then it is replaced whole)."""
    try:
        out = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except PermissionError:
        return None
    try:
        if not expect.same(os.fstat(out)):
            return None
        sent, crc, segs = copy_range(src, out, expect.size, op.size)
        _finish(out, op, segs, crc)
        return Result(Outcome.LANDED, Ident.of(os.fstat(out)), sent, appended=True)
    finally:
        os.close(out)


def partial_name(token: str, seq: int) -> str:
    return f".fanfs-{token}-{seq}.partial"


def _replace(fd: int, name: bytes, src: int, op: Op, token: str) -> Result:
    tmp = partial_name(token, op.seq)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=fd)  # an earlier attempt's, or a dead daemon's (recover.py)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(tmp, flags, 0o600, dir_fd=fd)
    try:
        sent, crc, segs = copy_range(src, out, 0, op.size)
        _finish(out, op, segs, crc)
        ident = Ident.of(os.fstat(out))
        try:
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise LandingError(f"{os.fsdecode(op.path)}: a directory at DEST is in the "
                                   "way") from None  # fmt: skip
            raise
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)
        raise
    finally:
        os.close(out)
    return Result(Outcome.LANDED, ident, sent)


def remove_partial(dest: Dest, path: bytes, token: str, seq: int) -> None:
    """The partial file of put `seq` at `path`, if one is there: a failed attempt's that
    could not be removed then (DEST refused), of a put that will not be tried again."""
    root = dest.root()
    try:
        fd, _ = open_parent(root, path, create=False)
    except FileNotFoundError:
        return
    finally:
        os.close(root)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial_name(token, seq), dir_fd=fd)
    finally:
        os.close(fd)


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
