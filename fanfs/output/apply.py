"""One journal op (journal.py) applied to DEST (dest.py), in a worker thread.

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

Every path is walked from DEST's checked root, never through a symlink (dest.py's safety).

Concurrency: these functions run in worker threads (the lander's, a replica holder's); an
`Op` is not changed while it is applied (journal.py: `busy`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable

from fanfs.output.dest import (
    DIR_FLAGS,
    Dest,
    Ident,
    LandingError,
    Outcome,
    Result,
    copy_range,
    open_parent,
    read_back,
)
from fanfs.output.journal import ATTR, MKDIR, PUT, RENAME, RMDIR, UNLINK, Op

log = logging.getLogger(__name__)


def _lstat(dir_fd: int, name: bytes) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


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
            d = os.open(name, DIR_FLAGS, dir_fd=fd)
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
