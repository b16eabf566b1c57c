"""The native read pool on the Python side: when it runs, and the jobs it is given.

fanfs's C extension (fanfs/native.py, fanfs/csrc/pool.c) answers FUSE READs in its own
threads: a read handler returns a `NativeJob` tuple instead of bytes, pyfuse3 hands it to the
extension's read hook (tools/install_pyfuse3.py's patch), and C threads read the stored pieces
(a whole file, or the frames of a framed file the READ touches), check their CRC-32, decode
them and answer the kernel without the GIL or the event loop. Then they push what the READ did
not ask for of the pieces they decoded into the kernel's page cache, so a large file costs one
or two round trips (the kernel's READs are at most 128 KiB for an unprivileged mount). A
failure answers EIO and posts an `ERROR_RECORD` on a pipe, which `NativePool.errors` turns
into the bad-file registry's marks when the stored bytes are bad (a failure of the moment,
ENOMEM or a disk's EIO, marks nothing: the next READ tries again).

`NativePool` says whether the pool runs and decodes (the Reader asks it) and builds the jobs
from the catalog. Registering the hook with pyfuse3 comes in from fuse_ops (`install_hook`),
the one module importing pyfuse3.

Concurrency: `start` and `stop` run in the main thread around the trio run (stop while the
FUSE session still exists, so queued READs are answered); `errors` and `followed` are trio
tasks; `held` and `ahead` run in any thread; the rest runs in the trio thread (`running` and
`decodes` are plain reads, safe anywhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.image import codec
from fanfs.logs import Throttle
from fanfs.native import lib
from fanfs.node.front import Front
from fanfs.node.jobs import (  # noqa: F401 (JOB_FIELDS, KIND_*: the tests read them here)
    JOB_FIELDS,
    KIND_FILTER,
    KIND_RAW,
    KIND_ZSTD,
    MAX_PIECES,
    NativeJob,
    fast_kinds,
    frame_piece,
    job,
    piece_kind,
    whole_piece,
)
from fanfs.status import LEGS, NO_FRONT, STAGES, FrontStatus

log = logging.getLogger(__name__)

# Pool threads: at least 4 (concurrent disk reads of small files, even on a 2-core node), and
# one per core up to 32 on bigger nodes, where decoding compressed files is what they do most.
THREADS = max(4, min(32, os.cpu_count() or 4))
# Files stored whole up to this size are answered by the pool also when a READ asks for a part
# (it keeps the decoded file in its cache of pieces, 64 MiB in all, for the other parts, and
# pushes them into the kernel's page cache).
PARTS_LIMIT = 4 << 20
FOLLOWED_AT_ONCE = 4096  # files the front recorded, taken per turn of the event loop
# The pool's failure record (native byte order): entry, errno, padding.
ERROR_RECORD = struct.Struct("=qii")
# The errnos of a record that make a file bad: its stored bytes fail their CRC-32, or do not
# decode. Any other is a failure of the moment (ENOMEM, a disk's EIO): nothing is marked.
BAD_DATA = frozenset((errno.EBADMSG, errno.EILSEQ))


def _stages(kind: str, sums: Sequence[int]) -> dict[str, int]:
    """A kind's READs ("<kind>_n") and nanoseconds per stage ("<kind>_<stage>_ns") from the C's
    sums (the READs, then each stage's)."""
    return {f"{kind}_n": sums[0], **{f"{kind}_{st}_ns": sums[1 + i] for i, st in enumerate(STAGES)}}


class NativePool:
    def __init__(self, catalog: cat.Catalog,
                 install_hook: Callable[[Any], None] | None,
                 failed: Callable[[int, BaseException], None], decode: bool = True,
                 push: bool = True, front: Front | None = None,
                 front_off: str = ""):  # fmt: skip
        """`install_hook(read_hook)`: registers the pool's hook with pyfuse3 (None where pyfuse3
        has no read hook: the Reader then reads in Python);
        `failed(entry, error)`: a file the pool found bad (the bad-file registry's `mark`);
        `decode`: False keeps compressed files in Python (FANFS_NATIVE_DECODE=0); `push`: False
        never pushes the rest of a piece into the page cache (FANFS_PUSH=0); `front`: threads
        that take requests from the FUSE device themselves and answer READs of staged files
        with no Python (None, or FANFS_FRONT=0: pyfuse3 takes them all); `front_off`: why
        there is none, for `fanfs status`."""
        self.catalog = catalog
        self.install_hook = install_hook
        self.failed = failed
        self._decode = decode
        self.front = front
        self.front_off = front_off
        self._throttle = Throttle()  # failed READs of one file: a warning a minute
        self.fast = False  # READs of staged files answered by the front (pool_fast)
        self._fast_parts: set[int] = set()
        self.flags = lib.JOB_PUSH if push else 0
        self._rfd = self._wfd = -1
        self._follow_fd = -1  # the front writes it when it has recorded files (planned epochs)
        self._following = trio.Event()
        self.running = False
        self.crc32 = lib.CRC_LIBRARY  # the library the pool checks CRCs with
        self.can_decode = False  # libzstd found and the image's dictionaries taken
        self.jobs = 0  # READs handed to the pool
        # Per entry, the piece kind the front's pool reads it as alone (jobs.fast_kinds), or
        # lib.FAST_NO; None while it has no front.
        self.kinds: np.ndarray | None = None

    @property
    def decodes(self) -> bool:
        """Whether compressed pieces go to the pool now."""
        return self.running and self.can_decode and self._decode

    def start(self, stack: contextlib.ExitStack) -> bool:
        """Start the pool with the image's dictionaries; False (and a warning) if this pyfuse3
        has no read hook or the pool cannot start. Without libzstd it runs for raw pieces."""
        if self.install_hook is None:
            return False
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        stack.callback(os.close, rfd)  # runs once trio is done with it
        try:
            lib.pool_start(THREADS, wfd)
        except OSError as e:
            os.close(wfd)
            log.warning("native read pool unavailable, reading in Python: %s", e)
            return False
        self._rfd, self._wfd = rfd, wfd  # wfd closes in stop, once the pool has stopped
        self.running = True
        stack.callback(self.stop)
        if self.crc32 != "isa-l":
            log.info("native read pool: CRC-32 by zlib (install libisal2 for a faster one)")
        try:
            if lib.DECODES:
                lib.pool_dicts(codec.dictionaries(tuple(self.catalog.dicts)))
                self.can_decode = True
        except OSError as e:
            log.warning("native read pool cannot take the image's dictionaries: %s", e)
        if not self.can_decode:
            log.info("native read pool: compressed files decoded in Python (no libzstd1)")
        self.install_hook(lib.read_hook())
        if self.front is not None:
            c = self.catalog
            self.kinds = fast_kinds(c, self.decodes)
            lib.pool_fast(c.size, c.part, c.data_off, c.stored_len, c.crc, self.kinds,
                          c.n_partitions, self.flags, PARTS_LIMIT)  # fmt: skip
            self.front.give_holders()
            lib.pool_fast_enable(True)
            self.fast = self.front.start(c, stack)
            if not self.fast:
                lib.pool_fast_enable(False)
            else:
                self._follow_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return True

    def fast_part(self, part: int, fd: int, dfd: int) -> None:
        """Partition `part` is staged: the fast path answers its files' READs from now on."""
        if self.fast and part not in self._fast_parts:
            self._fast_parts.add(part)
            lib.pool_fast_part(part, fd, dfd)

    def _front(self) -> lib.Front:
        """The front's C side: it runs whenever the fast path is on."""
        assert self.front is not None and self.front.native is not None
        return self.front.native

    def planned(self) -> None:
        """A planned epoch began: the front records the files it looks up and reads from
        their start (it answers them with no Python), for the plan to follow the job
        (`followed`), from now on."""
        if self.fast and not self._following.is_set():
            self._front().follow(self._follow_fd)
            self._following.set()
            log.info("planned epoch: the front tells the planner which files the job opens")

    async def followed(self) -> tuple[np.ndarray, np.ndarray]:
        """The next files the front recorded, oldest first: (entries, whether each was a
        READ, else a LOOKUP); waits for some (for ever without a planned epoch)."""
        await self._following.wait()
        while True:
            entries, reads, _ = self._front().followed(FOLLOWED_AT_ONCE)
            if len(entries):
                return entries, reads
            await trio.lowlevel.wait_readable(self._follow_fd)
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._follow_fd)

    def followed_lost(self) -> int:
        """Files the front could not record for the plan (its record was full)."""
        front = self.front.native if self.front is not None else None
        return int(front.followed(0)[2]) if front is not None else 0

    def held(self, entry: int, held: bool) -> None:
        """A planned epoch holds bytes of `entry` for its READ (its READs must reach the
        daemon), or not any more. Any thread."""
        if self.fast:
            lib.pool_plan_mark(entry, lib.PLAN_HELD, held)

    def ahead(self, entry: int, ahead: bool) -> None:
        """A planned epoch reads `entry` ahead (no read of it starts at its LOOKUP), or has
        done. Any thread."""
        if self.fast:
            lib.pool_plan_mark(entry, lib.PLAN_AHEAD, ahead)

    async def errors(self) -> None:
        """Mark the files the pool reports bad (their stored bytes fail their check or do not
        decode), until the pool stops. Other failures (ENOMEM, a disk's EIO) are the
        moment's: the READ was answered EIO, the next one tries again, so they are logged
        only."""
        while True:
            await trio.lowlevel.wait_readable(self._rfd)
            try:
                records = os.read(self._rfd, ERROR_RECORD.size * 256)
            except BlockingIOError:
                continue
            if not records:
                return  # the pool has stopped and its end is closed
            for entry, err, _ in ERROR_RECORD.iter_unpack(records):
                if 0 <= entry < self.catalog.n_entries and err in BAD_DATA:
                    self.failed(entry, CorruptFile(lib.failure_reason(err)))
                elif 0 <= entry < self.catalog.n_entries:
                    held = self._throttle.due(entry)
                    more = f" ({held} more since the last warning)" if held else ""
                    if held is not None:
                        log.warning("native read pool: a READ of %s failed (%s), answered EIO%s",
                                    os.fsdecode(b"/" + self.catalog.path(entry)),
                                    lib.failure_reason(err), more)  # fmt: skip
                else:  # a record the pool would never write: not worth ending the daemon
                    log.error("native read pool reported entry %d, errno %d", entry, err)

    def stop(self) -> None:
        """Answer what is queued, stop the threads, close the record pipe's write end."""
        if self.running:
            self.running = False
            assert self.install_hook is not None
            if self.front is not None:
                self.front.drain()  # the front answers READs until the pusher has stopped
            self.install_hook(None)
            lib.pool_stop()
            if self.front is not None:
                self.front.stop()
            if self._follow_fd >= 0:  # (no thread writes it any more, `followed` has ended)
                self._front().follow(-1)
                os.close(self._follow_fd)
                self._follow_fd = -1
            os.close(self._wfd)

    def stats(self) -> dict[str, int]:
        """The pool's counters (lib.pool_stats) and how its pieces were read (lib.read_stats)."""
        return {**lib.pool_stats(), **lib.read_stats(), "fast": lib.pool_fast_count()}

    def budget(self) -> dict[str, int]:
        """The latency budget (Status.budget) of the READs the front answered, the reads at
        LOOKUP and the fetches of peers' pieces (lib.Front.budget, lib.pool_budget); empty while
        the pool is off."""
        if not self.running:
            return {}
        ahead, legs = lib.pool_budget()
        out = dict(zip(("fetch_n", *(f"fetch_{leg}_ns" for leg in LEGS["fetch"])), legs,
                       strict=True))  # fmt: skip
        out.update(_stages("ahead", ahead))
        native = self.front.native if self.front is not None else None
        if native is not None:
            sums = native.budget()
            out.update(_stages("local", sums), **_stages("remote", sums[len(STAGES) + 1 :]))
            out["spin_ns"] = sums[-1]
        return out

    def front_status(self) -> FrontStatus:
        if self.front is not None:
            return self.front.statistics()
        return dataclasses.replace(NO_FRONT, off=self.front_off)

    def drop(self) -> None:
        """Empty the pool's cache of decoded pieces (cold measurements)."""
        lib.pool_drop()

    # -- jobs --------------------------------------------------------------------------------

    def whole(self, fd: int, dfd: int, entry: int, offset: int, size: int) -> NativeJob:
        """A job answering [offset, offset + size) of a file stored whole: the pool reads,
        checks and decodes all of it; when the request is a part it keeps the file in its
        cache of pieces (the rest is likely asked next) and pushes the rest to the kernel."""
        whole = offset == 0 and size == int(self.catalog.size[entry])
        piece = whole_piece(self.catalog, entry, 0 if whole else 1)
        self.jobs += 1
        return job(fd, dfd, entry, 0, offset, size, 0 if whole else self.flags, [piece])

    def frames(self, fd: int, dfd: int, entry: int, table: codec.FrameTable, offset: int,
               size: int, ahead: range) -> NativeJob | None:  # fmt: skip
        """A job answering [offset, offset + size) of a framed file from the frames it
        touches (None: more than MAX_PIECES), after queueing read-aheads of the frames in
        `ahead` (one job each, so that idle threads take them in parallel; pushed into the
        page cache too, as the kernel's own readahead would bring them)."""
        fs = table.frame_size
        first, last = offset // fs, (offset + size - 1) // fs
        if last - first >= MAX_PIECES:
            return None
        if self.running:
            for i in ahead:
                lib.pool_read_ahead(job(fd, dfd, entry, i * fs, 0, 0, self.flags,
                                        [frame_piece(self.catalog, entry, table, i)]))  # fmt: skip
        pieces = [frame_piece(self.catalog, entry, table, i) for i in range(first, last + 1)]
        self.jobs += 1
        return job(fd, dfd, entry, first * fs, offset - first * fs, size, self.flags, pieces)
