"""The partition store: where a partition's bytes come from, the staged local copy or the image.

Staging copies the partitions this daemon serves from the image into its private staging
directory (fanfs/node/staging.py: anonymous 0600 files that cannot outlive the daemon) with large
kernel-side copies (sendfile) in one background thread. Until a partition has landed, its
reads go to the image, so the mount serves at once. Swapping a partition's fd is one list-item
assignment, atomic under the GIL, and old fds stay open until `close`, so a reader that picked
the image fd just before the swap still reads valid bytes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fanfs.errors import StagingError
from fanfs.image import catalog as cat
from fanfs.node.keep import KeepDir
from fanfs.node.keys import partition_digest, partition_keys
from fanfs.node.partfile import (  # (image.py and daemon.py import these two from here)
    check_partitions as check_partitions,
)
from fanfs.node.partfile import open_direct
from fanfs.node.partfile import pread_exact as pread_exact
from fanfs.node.staging import StagingDir
from fanfs.progress import human_bytes
from fanfs.status import StoreStatus
from fanfs.threads import name_os_thread

log = logging.getLogger(__name__)

COPY_CHUNK = 64 << 20  # per sendfile call: large enough to stream, small enough to stop quickly
# Staging leaves this share of the local disk free (the job's own files, other jobs' data),
# at most RESERVE_MAX: a partition that would not leave it is read from the image instead.
RESERVE_SHARE = 20
RESERVE_MAX = 4 << 30
PROGRESS_INTERVAL_S = 10.0
# With --keep: how long staging waits for another daemon of the user staging the same
# partition into DIR, before staging it itself for this mount only (a suspended job holds it).
KEEP_WAIT_S = 300.0


class PartitionStore:
    def __init__(
        self,
        image: Path,
        catalog: cat.Catalog,
        local: Path,
        owned: Sequence[int],
        keep_local: bool = False,
        keep: Path | None = None,
        keep_size: int | None = None,
    ):
        self.image = image
        self.catalog = catalog
        self.owned = list(owned)
        for option, where in (("--local", local), ("--keep", keep)):
            if where is not None and image.resolve() in (where.resolve(), *where.resolve().parents):
                raise StagingError(f"{where}: {option} must not be inside the image directory")
        self.staging = StagingDir(local, keep_local)
        try:
            self.keep = KeepDir(keep, keep_size) if keep is not None else None
        except BaseException:
            self.staging.close()
            raise
        self._keys: dict[int, str] = {}  # content key of each owned partition, with --keep
        # Image fds open on first use: a daemon that owns 8 of 1024 partitions should not
        # open the other 1016 on the shared file system unless it has to fall back to them.
        self._fds: list[int] = [-1] * catalog.n_partitions
        # The staged copies opened O_DIRECT too (-1: not staged, or its file system cannot):
        # the native pool reads what the page cache does not hold through them, so a file read
        # through the mount is not cached twice (in the mount's pages and the copy's).
        self._dfds: list[int] = [-1] * catalog.n_partitions
        self._open_lock = threading.Lock()
        self.image_reads = 0
        self.image_read_bytes = 0
        self._old_fds: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.staged_parts = 0  # copied from the image by this mount
        self.adopted_parts = 0  # found in --keep DIR
        self.kept_parts = 0  # copied and left in --keep DIR for the next mount
        self.staged_bytes = 0
        self.stage_total = sum(int(catalog.part_size[p]) for p in self.owned)
        self.stage_seconds = 0.0
        self.stage_done = not self.owned
        self.stage_stopped = ""  # why staging stopped before the end
        self._staged_set = [False] * catalog.n_partitions
        self._nowait = hasattr(os, "RWF_NOWAIT")

    def fd(self, part: int) -> int:
        """The open file of partition `part`: the staged copy once staged, else the image's.
        Stays valid until `close` (a swap at staging keeps the old one open)."""
        fd = self._fds[part]
        if fd < 0:
            with self._open_lock:
                fd = self._fds[part]
                if fd < 0:  # a regular file only (a FIFO swapped in would block for ever)
                    fd = self._fds[part] = cat.open_regular(self.image / cat.partition_name(part))
        return fd

    def dfd(self, part: int) -> int:
        """Partition `part`'s staged copy opened O_DIRECT, or -1."""
        return self._dfds[part]

    def staged(self, part: int) -> bool:
        """Whether `fd(part)` is the staged copy (for good: it is never swapped again)."""
        return self._staged_set[part]

    def pread_cached(self, part: int, offset: int, length: int) -> bytearray | None:
        """The bytes if the page cache holds them all (never blocks on the disk), else None.

        preadv2(RWF_NOWAIT) answers EAGAIN instead of waiting for the disk, so the caller can
        read cached data inline and hand only real disk reads to a thread.
        """
        if not self._nowait:
            return None
        buf = bytearray(length)
        try:
            n = os.preadv(self.fd(part), [buf], offset, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self._nowait = False  # this file system cannot: always use threads
                return None
            raise
        if n != length:
            return None  # partly cached: the thread reads it all
        self.count_read(part, length)
        return buf

    def drop_pages(self) -> int:
        """Ask the kernel to drop the cached pages of every open partition (the staged copies
        and the image's); how many partitions were asked."""
        n = 0
        for fd in list(self._fds):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    # Dirty pages are not dropped: a copy staged seconds ago is still being
                    # written back, so wait for that first.
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
        return n

    def count_read(self, part: int, nbytes: int) -> None:
        """A read of `part` done elsewhere (the native pool): counted as the store's own."""
        if not self._staged_set[part]:
            self.image_reads += 1
            self.image_read_bytes += nbytes

    def pread(self, part: int, offset: int, length: int) -> bytes:
        self.count_read(part, length)
        return pread_exact(self.fd(part), length, offset, f"partition {part}")

    # -- staging ---------------------------------------------------------------------------

    def start_staging(self, staged: Callable[[int], None]) -> None:
        """Stage the owned partitions in a thread of its own, calling `staged(p)` there as each
        one's staged copy (or adopted one) becomes its source."""
        self._thread = threading.Thread(target=self._stage_all, args=(staged,), name="fanfs-stage",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _stage_all(self, staged: Callable[[int], None]) -> None:
        name_os_thread()
        start = time.monotonic()
        last_log = start
        try:
            todo = self.owned if self.keep is None else self._adopt_all()
            for p in self.owned:
                if self._staged_set[p]:  # adopted
                    staged(p)
            for p in todo:
                if self._stop.is_set():
                    return
                self._check_room(p)
                try:
                    if self.keep is None:
                        self._stage_one(p)
                    else:
                        self._stage_kept(p)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise  # the next partition would not fit either
                    # One unreadable partition (a bad sector of the image): the image stays
                    # its source, and its files get EIO only where the image fails too.
                    log.error("cannot stage partition %d, reading it from the image: %s", p, e)
                if self._staged_set[p]:
                    staged(p)
                now = time.monotonic()
                if now - last_log >= PROGRESS_INTERVAL_S:
                    last_log = now
                    log.info("staging: %s", self._stage_text(now - start))
            self.stage_seconds = time.monotonic() - start
            self.stage_done = True
            log.info("staged: %s", self._stage_text(self.stage_seconds))
        except OSError as e:
            # The image stays the source for every partition not staged: reads keep working.
            self.stage_stopped = e.strerror or str(e)
            log.error("staging stopped, reading the rest from the image: %s", self.stage_stopped)
        except Exception as e:
            self.stage_stopped = f"{type(e).__name__}: {e}"
            log.exception("staging failed, reading the rest from the image")

    def _adopt_all(self) -> list[int]:
        """Adopt each owned partition that --keep DIR holds, before any is staged (a few
        system calls each); the partitions left to stage."""
        assert self.keep is not None
        self._keys = partition_keys(self.catalog, self.owned)
        rest = []
        for p in self.owned:
            if self._stop.is_set():
                break
            fd = None
            try:
                with self.keep.claim(self._keys[p]) as got:  # busy: another mount stages it
                    if got:
                        fd = self.keep.adopt(self._keys[p], int(self.catalog.part_size[p]))
            except OSError as e:  # this entry only: staged again below
                log.warning("cannot adopt partition %d from %s: %s", p, self.keep.path, e)
            if fd is None:
                rest.append(p)
            else:
                self._swap(p, fd)
                self.adopted_parts += 1
        if self.adopted_parts:
            log.info("adopted %d of %d partitions from %s", self.adopted_parts, len(self.owned),
                     self.keep.path)  # fmt: skip
        return rest

    def _check_room(self, p: int) -> None:
        """ENOSPC if staging partition `p` would leave less than the reserve free."""
        st = os.fstatvfs(self.staging.fd if self.keep is None else self.keep.fd)
        where = self.staging.path if self.keep is None else self.keep.path
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        reserve = min(RESERVE_MAX, total // RESERVE_SHARE)
        size = int(self.catalog.part_size[p])
        if free - size < reserve:
            raise OSError(errno.ENOSPC, f"No space left: partition {p} ({human_bytes(size)}) "
                          f"would leave less than {human_bytes(reserve)} free in "
                          f"{where}")  # fmt: skip

    def _stage_text(self, seconds: float) -> str:
        rate = self.staged_bytes / max(seconds, 1e-9) / 1e6
        return (
            f"{self.staged_parts}/{len(self.owned)} partitions, "
            f"{human_bytes(self.staged_bytes)}/{human_bytes(self.stage_total)} "
            f"in {seconds:.1f} s ({rate:.0f} MB/s) to "
            f"{self.staging.path if self.keep is None else self.keep.path}"
        )

    def _copy(self, p: int, out: int) -> bool:
        """Partition `p` from the image into `out`; False if stopped first."""
        size = int(self.catalog.part_size[p])
        done = 0
        while done < size and not self._stop.is_set():
            sent = os.sendfile(out, self.fd(p), done, min(COPY_CHUNK, size - done))
            if sent == 0:
                raise OSError(errno.EIO, f"partition {p} ended early while staging")
            done += sent
            self.staged_bytes += sent
        return done == size

    def _stage_one(self, p: int) -> None:
        name = cat.partition_name(p)
        out = self.staging.create(name)
        try:
            complete = self._copy(p, out)
            if complete:
                self.staging.publish(out, name)
        except BaseException:
            os.close(out)  # an anonymous file: closing it frees its space
            self.staging.discard(name)
            raise
        if not complete:
            os.close(out)
            self.staging.discard(name)
            return
        self._swap(p, out)
        self.staged_parts += 1

    def _stage_kept(self, p: int) -> None:
        """Partition `p` adopted from --keep DIR if another mount kept it meanwhile, else
        staged into DIR and kept there."""
        assert self.keep is not None
        key, size = self._keys[p], int(self.catalog.part_size[p])
        with self.keep.claim(key, self._stop, KEEP_WAIT_S) as got:
            if not got:
                if not self._stop.is_set():
                    log.info("partition %d: not kept (its entry in %s is busy or unusable)",
                             p, self.keep.path)  # fmt: skip
                    self._stage_one(p)
                return
            fd = self.keep.adopt(key, size)
            if fd is not None:
                self._swap(p, fd)
                self.adopted_parts += 1
                return
            out = self.keep.create()
            try:
                complete = self._copy(p, out)
            except BaseException:
                os.close(out)
                raise
            if not complete:
                os.close(out)
                return
            try:
                wanted = set(self._keys.values())
                digest = partition_digest(self.catalog, p)
                kept = self.keep.publish(out, key, size, str(self.image), p, digest, wanted)
            except OSError as e:
                log.warning("partition %d staged but not kept in %s: %s", p, self.keep.path, e)
                kept = False
            except BaseException:
                os.close(out)
                raise
        self._swap(p, out)
        self.staged_parts += 1
        self.kept_parts += kept

    def _swap(self, p: int, out: int) -> None:
        """From now on partition `p` is read from local copy `out`. Under the lock `fd` opens
        the image's file with: an adopted partition's image file may never have been opened,
        and a reader opening it now must not put it back over `out`."""
        dfd = open_direct(out)
        with self._open_lock:
            self._old_fds.append(self._fds[p])
            self._dfds[p] = dfd
            self._fds[p] = out  # atomic swap: later reads of this partition are local
            self._staged_set[p] = True

    # -- lifecycle -------------------------------------------------------------------------

    def statistics(self) -> StoreStatus:
        keep = self.keep
        return StoreStatus(
            local_dir=str(self.staging.path),
            partitions_owned=len(self.owned),
            partitions_staged=self.staged_parts,
            bytes_staged=self.staged_bytes,
            bytes_to_stage=self.stage_total,
            staging_done=self.stage_done,
            staging_seconds=round(self.stage_seconds, 3),
            image_reads=self.image_reads,
            staging_stopped=self.stage_stopped,
            keep_dir=str(keep.path) if keep is not None else "",
            partitions_adopted=self.adopted_parts,
            partitions_kept=self.kept_parts,
            partitions_evicted=keep.evicted if keep is not None else 0,
            kept_replaced=keep.replaced if keep is not None else 0,
            bytes_from_image=self.staged_bytes + self.image_read_bytes,
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for fd in self._fds + self._old_fds + self._dfds:
            if fd >= 0:
                os.close(fd)
        self._fds = []
        self._dfds = []
        self._old_fds = []
        if self.keep is not None:
            self.keep.close()
        self.staging.close()
