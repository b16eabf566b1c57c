"""Kept partitions: staged copies that outlive the job, for the next job on the same node.

`fanfs mount IMAGE MNT --keep DIR` stages into DIR and leaves the copies there at the end; the
next mount with the same DIR adopts every copy whose content its own catalog names, and stages
only the rest. DIR belongs to the user who runs the job, on the node's local disk, outside the
job's /tmp (which Slurm may wipe); others may not write to it.

An entry of DIR, for a partition whose content key (fanfs/node/keys.py) is K:
- `K.pack`: the partition's bytes, exactly, mode 0400, one name;
- `K.seal`: what the daemon that kept it saw once the copy was complete and named (size,
  device, inode and ctime of `K.pack`, the key, the image and partition it came from). Its
  mtime is the entry's last use: eviction takes the least recently used first;
- `K.lock`: an empty file, flock'ed while a daemon checks, stages or evicts K, so two daemons
  of the user sharing DIR never write one entry twice; left in place (`fanfs keep prune`
  removes those of entries that are gone).

Adoption trusts an entry only if its seal matches it: any change made to `K.pack` through the
file system since it was sealed (a write, a truncation, a rename over it, a new file planted
under its name, a chmod) changes its ctime or inode, and a symlink, a file of another user or
a second name is refused outright. Such an entry is never served: it is removed (when it is
the user's own) and staged again. This check costs a few system calls per partition, so a
second job adopts its share in milliseconds; the bytes are checked where they are used, by the
CRC-32 of every file that each READ already checks (a disk that corrupts what it stores without
a write gives EIO for that file, never wrong bytes).

An adopted or freshly kept entry is held with a shared flock for the whole mount: eviction
(`--keep-size`, `fanfs keep prune`) takes an exclusive one without waiting and skips entries
in use, so nothing is removed under a reader.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

from fanfs.errors import StagingError
from fanfs.node.keep_entries import KeepEntries, flock
from fanfs.node.keys import key_of_digest
from fanfs.node.staging import anonymous
from fanfs.progress import human_bytes

log = logging.getLogger(__name__)


def check_dir(path: Path) -> None:
    """Refuse a DIR that is not the user's own, or that others may write to."""
    st = os.stat(path)  # a symlink to the real directory is fine: that directory is checked
    if not stat.S_ISDIR(st.st_mode):
        raise StagingError(f"{path}: --keep is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise StagingError(f"{path}: --keep belongs to uid {st.st_uid}, not to you (uid {me}): "
                           "kept partitions live in a directory of your own")  # fmt: skip
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        raise StagingError(f"{path}: --keep is writable by other users (mode {mode:04o}): "
                           "chmod go-w it, or use another")  # fmt: skip


class KeepDir(KeepEntries):
    """DIR opened once; every operation is relative to its fd, so renaming or replacing the
    directory afterwards cannot redirect a write."""

    def __init__(self, path: Path, budget: int | None = None):
        self.path = Path(os.path.abspath(path))
        self.budget = budget
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_dir(self.path)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StagingError(f"{self.path}: cannot use as --keep: {e.strerror}") from None
        try:  # fail now, not at the first partition, where locks do not work
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError as e:
            os.close(self.fd)
            raise StagingError(
                f"{self.path}: --keep needs a file system that can lock files "
                f"({e.strerror}): use one on the node's local disk"
            ) from None
        self._me = os.geteuid()
        self._tmpfile = True  # until the file system says it cannot
        self._held: list[int] = []  # entries in use by this mount (their shared flocks)
        self._foreign: set[str] = set()  # keys whose K.pack is another user's (said once)
        self._unlockable: set[str] = set()  # keys whose K.lock cannot be opened (said once)
        self._lock = threading.Lock()
        self.evicted = 0
        self.replaced = 0

    # -- one key at a time -----------------------------------------------------------------

    def adopt(self, key: str, size: int) -> int | None:
        """K.pack open read-only and held for this mount, if its seal vouches for it; None
        otherwise (a bad entry of the user's is removed, and why is logged). Call under
        `claim(key)`."""
        try:
            st = os.lstat(f"{key}.pack", dir_fd=self.fd)
        except FileNotFoundError:
            return None
        if st.st_uid != self._me:
            self._say_foreign(key, st.st_uid)
            return None
        if not stat.S_ISREG(st.st_mode):  # never opened
            self._drop(key, "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file")
            return None
        try:
            fd = os.open(f"{key}.pack", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)  # fmt: skip
        except FileNotFoundError:
            return None
        except OSError as e:
            self._drop(key, f"unreadable ({e.strerror})")
            return None
        st = os.fstat(fd)
        if st.st_uid != self._me:  # replaced between the lstat and the open
            os.close(fd)
            self._say_foreign(key, st.st_uid)
            return None
        refused = self._refusal(st, key, size)
        if refused is not None:
            os.close(fd)
            self._drop(key, refused)
            return None
        if not flock(fd, fcntl.LOCK_SH, wait_s=1.0):  # `fanfs keep prune` checking it
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            os.utime(f"{key}.seal", dir_fd=self.fd, follow_symlinks=False)
        self._hold(fd)
        return os.dup(fd)

    def _say_foreign(self, key: str, uid: int) -> None:
        if key not in self._foreign:
            self._foreign.add(key)
            log.warning("%s.pack in %s belongs to uid %d: left alone, and partition not kept",
                        key[:16], self.path, uid)  # fmt: skip

    def _drop(self, key: str, why: str) -> None:
        """Remove K.pack and K.seal where they are the user's (never another user's file)."""
        log.warning("kept partition %s in %s not used: %s; staging it again", key[:16],
                    self.path, why)  # fmt: skip
        self.replaced += 1
        for name in (f"{key}.pack", f"{key}.seal"):
            self._unlink_own(name)

    def create(self) -> int:
        """A new file in DIR for a partition being staged, nameless until `publish`."""
        if self._tmpfile:
            fd = anonymous(self.fd)
            if fd is not None:
                return fd
            self._tmpfile = False
        # Without O_TMPFILE: a unique name, gone at once; such a copy cannot be linked again,
        # so it serves this mount and is not kept (every local Linux file system has O_TMPFILE).
        name = f".staging-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self.fd)  # fmt: skip
        os.unlink(name, dir_fd=self.fd)
        return fd

    def publish(self, fd: int, key: str, size: int, image: str, part: int, digest: bytes,
                wanted: set[str]) -> bool:  # fmt: skip
        """Name the complete copy `fd` K.pack and seal it, evicting least recently used
        entries first if the budget needs it (never one in `wanted` or in use). False when
        it is not kept (no room in the budget, or a file of someone else holds the name): the
        copy is still this mount's, and goes at the end. Call under `claim(key)`."""
        if not self._room(size, wanted | {key}):
            log.info("not keeping partition %d: the --keep-size budget (%s) is in use",
                     part, human_bytes(self.budget or 0))  # fmt: skip
            return False
        os.fdatasync(fd)  # a seal never vouches for bytes still in the page cache only
        os.fchmod(fd, 0o400)  # read-only: a stray write of the user's fails instead of landing
        flock(fd, fcntl.LOCK_SH)
        try:
            if not self._tmpfile:
                raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE")
            os.link(f"/proc/self/fd/{fd}", f"{key}.pack", dst_dir_fd=self.fd, follow_symlinks=True)
        except FileExistsError:
            return False  # another user's file has the name (said by `adopt`)
        except OSError:
            # No O_TMPFILE (or no /proc): the copy has no name to link from.
            return False
        if digest and key_of_digest(size, digest) != key:
            digest = b""  # keyed by the CRCs: the seal vouches for no SHA-256
        st = os.fstat(fd)  # after the link, which changed its ctime
        seal = {"key": key, "size": size, "dev": st.st_dev, "ino": st.st_ino,
                "ctime_ns": st.st_ctime_ns, "image": image, "part": part,
                "sha256": digest.hex(), "kept": time.time()}  # fmt: skip
        tmp = f"{key}.seal.tmp"
        self._unlink_own(tmp)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=self.fd)  # fmt: skip
        try:
            os.write(out, json.dumps(seal).encode())
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, f"{key}.seal", src_dir_fd=self.fd, dst_dir_fd=self.fd)
        self._hold(os.dup(fd))
        return True

    def _hold(self, fd: int) -> None:
        with self._lock:
            self._held.append(fd)

    # -- the budget ------------------------------------------------------------------------

    def _room(self, size: int, wanted: set[str]) -> bool:
        if self.budget is None:
            return True
        if size > self.budget:
            return False
        if self.usage() + size <= self.budget:
            return True
        entries = self.entries()
        used = sum(e.size for e in entries)
        for e in entries:
            if used + size <= self.budget:
                break
            if e.key not in wanted and not e.in_use and self.evict(e.key):
                used -= e.size
        return used + size <= self.budget

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for fd in held:
            os.close(fd)
        os.close(self.fd)
