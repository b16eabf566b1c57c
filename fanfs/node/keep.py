"""Kept partitions: staged copies that outlive the job, for the next job on the same node.

`fanfs mount IMAGE MNT --keep DIR` stages into DIR and leaves the copies there at the end; the
next mount with the same DIR adopts every copy whose content its own catalog names, and stages
only the rest. DIR belongs to the user who runs the job, on the node's local disk, outside the
job's /tmp (which Slurm may wipe); others may not write to it.

An entry of DIR, for a partition whose content key (`partition_keys`) is K:
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
import hashlib
import json
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fanfs import catalog as cat
from fanfs.errors import StagingError
from fanfs.progress import human_bytes

log = logging.getLogger(__name__)

# Two kinds of key, never equal: from the catalog's SHA-256 of the partition (images of format
# 4 on), else from its files' CRCs (older images). Each changes when what it covers changes.
KEY_SHA = b"fanfs-keep sha256 1\0"
KEY_VERSION = b"fanfs-keep 1\0"
SEAL_MAX = 4096  # bytes of a seal read at most (a planted huge one is refused)
LOCK_POLL_S = 0.05
# A daemon's files in DIR: nothing else there (a user's own files) is ever listed or removed.
NAME = re.compile(r"([0-9a-f]{64})\.(pack|seal|lock|seal\.tmp)")
_TMPFILE = getattr(os, "O_TMPFILE", 0)


def partition_keys(catalog: cat.Catalog, parts: Sequence[int]) -> dict[int, str]:
    """The content key of each partition in `parts`, so that an unchanged partition of a
    re-prepared image has the same key and a changed file changes its partition's: from the
    SHA-256 of the partition's bytes that the catalog records (format 4), else from its size
    and the offset, stored length and CRC-32 of every file in it, in on-disk order (prepare
    packs a partition's files back to back, so these describe every byte of it, but a changed
    file of the same length and CRC-32 would keep the key)."""
    c = catalog
    digests = {p: partition_digest(c, p) for p in parts}
    if all(digests.values()):
        return {p: key_of_digest(int(c.part_size[p]), digests[p]) for p in parts}
    files = np.flatnonzero(c.is_file & (c.part != cat.NO_PARTITION))
    files = files[np.lexsort((c.data_off[files], c.part[files]))]
    in_part = c.part[files]
    keys = {}
    for p in parts:
        lo, hi = np.searchsorted(in_part, [p, p + 1])
        ids = files[lo:hi]
        h = hashlib.sha256(KEY_VERSION)
        h.update(struct.pack("<QQ", int(c.part_size[p]), len(ids)))
        for column, dtype in ((c.data_off, "<u8"), (c.stored_len, "<u8"), (c.crc, "<u4")):
            h.update(np.ascontiguousarray(column[ids], dtype=dtype).tobytes())
        keys[p] = h.hexdigest()
    return keys


def partition_digest(catalog: cat.Catalog, part: int) -> bytes:
    """The partition's SHA-256 from the catalog; b"" for images older than format 4 (or a
    catalog that left it zero)."""
    if catalog.part_sha256 is None:
        return b""
    digest: bytes = catalog.part_sha256[part].tobytes()
    return b"" if digest == bytes(32) else digest


def key_of_digest(size: int, digest: bytes) -> str:
    return hashlib.sha256(KEY_SHA + struct.pack("<Q", size) + digest).hexdigest()


@dataclass(frozen=True, slots=True)
class Entry:
    """One kept partition as `fanfs keep ls` shows it."""

    key: str
    size: int
    last_used: float  # the seal's mtime; 0 if it has none
    image: str
    part: int
    in_use: bool


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


class KeepDir:
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
        self._tmpfile = bool(_TMPFILE)
        self._held: list[int] = []  # entries in use by this mount (their shared flocks)
        self._foreign: set[str] = set()  # keys whose K.pack is another user's (said once)
        self._unlockable: set[str] = set()  # keys whose K.lock cannot be opened (said once)
        self._lock = threading.Lock()
        self.evicted = 0
        self.replaced = 0

    # -- one key at a time -----------------------------------------------------------------

    @contextlib.contextmanager
    def claim(self, key: str, stop: threading.Event | None = None,
              wait_s: float = 0.0) -> Iterator[bool]:  # fmt: skip
        """Hold K.lock while the body runs (True); False if another daemon holds it for
        `wait_s` seconds, or until `stop` is set, or if K.lock cannot be opened (not a file of
        the user's: said once, and that partition is not kept)."""
        while True:
            try:
                fd = os.open(f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, 0o600, dir_fd=self.fd)  # fmt: skip
            except OSError as e:
                if key not in self._unlockable:
                    self._unlockable.add(key)
                    log.warning("%s.lock in %s cannot be opened (%s): partition not kept",
                                key[:16], self.path, e.strerror)  # fmt: skip
                yield False
                return
            try:
                got = _flock(fd, fcntl.LOCK_EX, stop, wait_s)
                if got and not _same(fd, f"{key}.lock", self.fd):
                    continue  # pruned while we waited: lock the name's new file
                yield got
                return
            finally:
                os.close(fd)  # releases the lock

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
        if not _flock(fd, fcntl.LOCK_SH, wait_s=1.0):  # `fanfs keep prune` checking it
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

    def _refusal(self, st: os.stat_result, key: str, size: int) -> str | None:
        """Why the user's K.pack (whose fstat is `st`) must not be served, or None."""
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_mode & 0o222:
            return f"writable (mode {stat.S_IMODE(st.st_mode):04o})"
        if st.st_size != size:
            return f"{st.st_size} bytes, the partition has {size}"
        if st.st_nlink != 1:
            return f"{st.st_nlink} names"
        seal = self._seal(key)
        if seal is None:
            return "no seal"
        sealed = tuple(seal.get(k) for k in ("key", "size", "dev", "ino", "ctime_ns"))
        if sealed != (key, size, st.st_dev, st.st_ino, st.st_ctime_ns):
            return "changed since it was kept"
        return None

    def _seal(self, key: str) -> dict[str, object] | None:
        try:
            fd = os.open(f"{key}.seal", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)  # fmt: skip
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            seal = json.loads(os.read(fd, SEAL_MAX + 1)[: SEAL_MAX + 1])
            return seal if isinstance(seal, dict) else None
        except Exception:  # anything in it (a RecursionError too): no seal
            return None
        finally:
            os.close(fd)

    def _drop(self, key: str, why: str) -> None:
        """Remove K.pack and K.seal where they are the user's (never another user's file)."""
        log.warning("kept partition %s in %s not used: %s; staging it again", key[:16],
                    self.path, why)  # fmt: skip
        self.replaced += 1
        for name in (f"{key}.pack", f"{key}.seal"):
            self._unlink_own(name)

    def _unlink_own(self, name: str) -> bool:
        try:
            if os.lstat(name, dir_fd=self.fd).st_uid != self._me:
                return False
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove %s from %s: %s", name, self.path, e.strerror)
            return False
        return True

    def create(self) -> int:
        """A new file in DIR for a partition being staged, nameless until `publish`."""
        if self._tmpfile:
            try:
                return os.open(".", os.O_RDWR | _TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
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
        _flock(fd, fcntl.LOCK_SH)
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

    def usage(self) -> int:
        """Bytes of the user's kept partitions in DIR."""
        total = 0
        for name in os.listdir(self.fd):
            if _kind(name) == "pack":
                with contextlib.suppress(OSError):
                    st = os.lstat(name, dir_fd=self.fd)
                    if st.st_uid == self._me and stat.S_ISREG(st.st_mode):
                        total += st.st_size
        return total

    def entries(self) -> list[Entry]:
        """Every kept partition of the user's in DIR, least recently used first."""
        out = []
        for name in os.listdir(self.fd):
            if _kind(name) != "pack":
                continue
            key = name[: -len(".pack")]
            try:
                st = os.lstat(name, dir_fd=self.fd)
            except OSError:
                continue
            if st.st_uid != self._me or not stat.S_ISREG(st.st_mode):
                continue
            seal = self._seal(key) or {}
            try:
                used = os.stat(f"{key}.seal", dir_fd=self.fd, follow_symlinks=False).st_mtime
            except OSError:
                used = 0.0
            part = seal.get("part")
            part = part if isinstance(part, int) else -1
            out.append(Entry(key, st.st_size, used, str(seal.get("image", "?")), part,
                             self._in_use(name)))  # fmt: skip
        return sorted(out, key=lambda e: (e.last_used, e.key))

    def _in_use(self, name: str) -> bool:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)  # fmt: skip
        except OSError:
            return False
        try:
            return not _flock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)

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

    def verify(self, key: str) -> str | None:
        """Why entry K is not what it was kept as, reading all of its bytes against the
        SHA-256 its seal has from the catalog; None if it is; "" if it cannot tell (a copy of
        an image older than format 4 has no SHA-256: its bytes are checked by each READ)."""
        seal = self._seal(key)
        if seal is None:
            return "no seal"
        size, digest = seal.get("size"), seal.get("sha256")
        if not isinstance(size, int) or not isinstance(digest, str):
            return "its seal does not say its size" if not isinstance(size, int) else ""
        try:
            digest_bytes = bytes.fromhex(digest)
        except ValueError:
            return "its seal does not parse"
        if not digest_bytes:
            return ""
        if key_of_digest(size, digest_bytes) != key:
            return "its seal is another partition's"
        try:
            fd = os.open(f"{key}.pack", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)  # fmt: skip
        except OSError as e:
            return f"cannot be opened ({e.strerror})"
        try:
            st = os.fstat(fd)
            refused = self._refusal(st, key, size) if st.st_uid == self._me else "not yours"
            if refused is not None:
                return refused
            sha = hashlib.sha256()
            while chunk := os.read(fd, 8 << 20):
                sha.update(chunk)
        except OSError as e:
            return f"unreadable ({e.strerror})"
        finally:
            os.close(fd)
        return None if sha.digest() == digest_bytes else "its bytes changed (SHA-256 mismatch)"

    def evict(self, key: str) -> bool:
        """Remove entry K unless a daemon holds or checks it (never waits)."""
        with self.claim(key) as got:
            if not got:
                return False
            try:
                fd = os.open(f"{key}.pack", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC, dir_fd=self.fd)  # fmt: skip
            except FileNotFoundError:
                fd = -1
            except OSError:
                return False  # it cannot be checked for readers: left alone
            try:
                if fd >= 0 and not _flock(fd, fcntl.LOCK_EX):
                    return False  # in use by a mount
                removed = self._unlink_own(f"{key}.pack")
                self._unlink_own(f"{key}.seal")
            finally:
                if fd >= 0:
                    os.close(fd)
        if removed:
            self.evicted += 1
            log.info("evicted kept partition %s from %s", key[:16], self.path)
        return removed

    def prune_leftovers(self) -> int:
        """Remove the seals and lock files of entries that are gone (none a daemon holds)."""
        n = 0
        for name in os.listdir(self.fd):
            kind = _kind(name)
            key = name.partition(".")[0]
            if kind in (None, "pack") or self._exists(f"{key}.pack"):
                continue
            with self.claim(key) as got:
                if got and not self._exists(f"{key}.pack"):
                    n += self._unlink_own(name)
        return n

    def _exists(self, name: str) -> bool:
        try:
            os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for fd in held:
            os.close(fd)
        os.close(self.fd)


def _flock(fd: int, how: int, stop: threading.Event | None = None, wait_s: float = 0.0) -> bool:
    """flock `fd`; False if it is held elsewhere for `wait_s` seconds or until `stop` is set,
    or if the file system refuses (KeepDir checked it can lock when it opened DIR)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.wait(min(LOCK_POLL_S, left))):
                return False
            if stop is None:
                time.sleep(min(LOCK_POLL_S, left))
        except OSError:
            return False


def _kind(name: str) -> str | None:
    """The kind of a name of fanfs's in DIR ("pack", "seal", "lock", "seal.tmp"), else None."""
    m = NAME.fullmatch(name)
    return m.group(2) if m else None


def _same(fd: int, name: str, dir_fd: int) -> bool:
    """Whether open file `fd` is still the one called `name` (not removed and recreated)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
