"""Private staging: where a daemon keeps its partition copies, out of other local users' reach.

Threat (docs/security.md): staging lives in a shared directory such as /tmp, where any local
user can create names before the daemon does, plant symlinks, or read what is left readable.

Guarantees, by construction rather than by checks on each path:
- `--local DIR` is only the parent. DIR must be owned by the daemon's user (or root) and, if
  others may write to it, carry the sticky bit (as /tmp does); anything else is refused with a
  clear error. In DIR the daemon creates its own staging directory with `mkdtemp` (a fresh,
  unpredictable name, O_EXCL, mode 0700), so no two daemons ever share one and nothing that
  was in DIR before (another image, someone's data) is ever written or deleted.
- Every operation in the staging directory is relative to a directory fd opened once:
  renaming or replacing the directory afterwards cannot redirect a write.
- A staged partition is an anonymous file (O_TMPFILE, mode 0600) that never has a name unless
  `--keep-local` asks for one at the end (linkat, which never follows or replaces). Whatever
  ends the daemon, even SIGKILL or ENOSPC mid-copy, the kernel frees the space when the last fd
  closes: staged data cannot outlive its daemon. Where the file system lacks O_TMPFILE, the
  file is created O_CREAT|O_EXCL|O_NOFOLLOW with mode 0600 and unlinked as soon as it is open.
- A `--local` that the daemon had to create (mode 0700) is removed at the end when empty.
- What can be left is an empty staging directory (after SIGKILL): the next daemon with the same
  DIR removes empty ones whose daemon is gone (rmdir only, so a directory holding anything,
  e.g. kept partitions, is never removed), and so does the Slurm epilog.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from pathlib import Path

from fanfs.errors import StagingError

log = logging.getLogger(__name__)

PREFIX = "fanfs-stage-"  # then "<pid>-<random>": the pid lets a later daemon see it is stale
_TMPFILE = getattr(os, "O_TMPFILE", 0)


def default_parent() -> str:
    """Where a daemon stages by default: the node's temporary directory."""
    return os.environ.get("TMPDIR") or "/tmp"


def anonymous(dir_fd: int) -> int | None:
    """A new nameless file (O_TMPFILE, mode 0600) in directory `dir_fd`, open read-write; None
    where the file system cannot make one."""
    if not _TMPFILE:
        return None
    try:
        return os.open(".", os.O_RDWR | _TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        return None


def check_parent(path: Path) -> None:
    """Refuse a parent another user could tamper with: owned by someone else, or writable by
    others without the sticky bit (which stops them renaming or deleting our directory)."""
    try:
        st = os.stat(path)  # symlinks resolved: the directory that will hold ours is checked
    except OSError as e:
        raise StagingError(f"{path}: cannot use as --local: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StagingError(f"{path}: --local is not a directory")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise StagingError(
            f"{path}: --local belongs to uid {st.st_uid}, not to you (uid {me}): refusing to "
            "stage where another user controls the directory"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StagingError(
            f"{path}: --local is writable by other users and not sticky (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): refusing to stage there"
        )


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep(parent_fd: int) -> None:
    """Remove empty staging directories of this user whose daemon is gone (rmdir only)."""
    me = os.geteuid()
    for name in os.listdir(parent_fd):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_uid == me:
                os.rmdir(name, dir_fd=parent_fd)
                log.info("removed the empty staging directory of a dead daemon: %s", name)


class StagingDir:
    """This daemon's own staging directory and the anonymous files in it."""

    def __init__(self, parent: Path, keep: bool = False):
        self.keep = keep
        parent = Path(os.path.abspath(parent))
        self._made_parent = not parent.exists()  # then it goes too, when empty, at the end
        if self._made_parent:
            try:
                parent.mkdir(mode=0o700, parents=True)
            except OSError as e:
                raise StagingError(f"{parent}: cannot create --local: {e.strerror}") from None
        check_parent(parent)
        self._parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):
                sweep(self._parent_fd)
            self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            os.close(self._parent_fd)
            raise StagingError(f"{parent}: cannot create a staging directory: {e}") from None
        self._tmpfile = bool(_TMPFILE)

    def create(self, name: str) -> int:
        """A new private file for the partition to be called `name`, open read-write. It has
        no name (or loses it at once) unless `publish` gives it one."""
        if self._tmpfile:
            fd = anonymous(self.fd)
            if fd is not None:
                return fd
            self._tmpfile = False  # this file system cannot: named files from now on
        partial = f"{name}.partial"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(partial, flags, 0o600, dir_fd=self.fd)
        if not self.keep:
            os.unlink(partial, dir_fd=self.fd)
        return fd

    def publish(self, fd: int, name: str) -> None:
        """With --keep-local: give a complete staged file its name (never replacing one)."""
        if not self.keep:
            return
        if self._tmpfile:
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=self.fd, follow_symlinks=True)
        else:
            os.rename(f"{name}.partial", name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def discard(self, name: str) -> None:
        """An incomplete file's name, if it has one (no O_TMPFILE and --keep-local)."""
        if self.keep and not self._tmpfile:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{name}.partial", dir_fd=self.fd)

    def keep_contents(self) -> None:
        """Keep the directory and what is in it at `close` (files that must not be lost)."""
        self.keep = True

    def close(self) -> None:
        """Remove the staging directory unless partitions were kept in it."""
        os.close(self.fd)
        try:
            if self.keep:
                log.info("kept %s and what it holds", self.path)
            else:
                os.rmdir(self.path.name, dir_fd=self._parent_fd)
                if self._made_parent:
                    with contextlib.suppress(OSError):  # not empty: someone else uses it now
                        self.path.parent.rmdir()
        except OSError as e:
            log.warning("left %s in place: %s", self.path, e.strerror)
        finally:
            os.close(self._parent_fd)
