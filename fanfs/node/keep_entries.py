"""The entries of a --keep DIR (fanfs/node/keep.py) as files: their names, seals and locks;
listing, checking, evicting and pruning them. What adopts and keeps them is KeepDir.

Only names of fanfs's own form (`<64 hex digits>.pack|seal|lock|seal.tmp`) are ever listed or
removed, and only files of the user's: anything else in DIR is left alone."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fanfs.node.keys import key_of_digest

log = logging.getLogger(__name__)

SEAL_MAX = 4096  # bytes of a seal read at most (a planted huge one is refused)
LOCK_POLL_S = 0.05
# A daemon's files in DIR: nothing else there (a user's own files) is ever listed or removed.
NAME = re.compile(r"([0-9a-f]{64})\.(pack|seal|lock|seal\.tmp)")


@dataclass(frozen=True, slots=True)
class Entry:
    """One kept partition as `fanfs keep ls` shows it."""

    key: str
    size: int
    last_used: float  # the seal's mtime; 0 if it has none
    image: str
    part: int
    in_use: bool


class KeepEntries:
    """What every user of DIR's entries needs (KeepDir opens DIR and sets these)."""

    fd: int  # DIR, opened once: every operation is relative to it
    path: Path
    _me: int  # the user (euid): only their files are ever used or removed
    _unlockable: set[str]
    evicted: int

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
                got = flock(fd, fcntl.LOCK_EX, stop, wait_s)
                if got and not _same(fd, f"{key}.lock", self.fd):
                    continue  # pruned while we waited: lock the name's new file
                yield got
                return
            finally:
                os.close(fd)  # releases the lock

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
            return not flock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)

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
                if fd >= 0 and not flock(fd, fcntl.LOCK_EX):
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


def flock(fd: int, how: int, stop: threading.Event | None = None, wait_s: float = 0.0) -> bool:
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
