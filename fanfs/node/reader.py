"""The read path: turn (entry, offset, size) into bytes, checked against the file's checksum.

How a READ is answered, in order: a file found bad is EIO at once; bytes a planned epoch read
ahead and holds (fanfs/node/plans.py) are handed over; a file this daemon holds goes to the
native pool when it runs (fanfs/node/pool.py: a whole file, or the frames a READ touches of
a framed one: C threads read, check, decode and answer the kernel); the rest is read here:
small and compressed files whole on first touch (one fetch, checked, decoded, kept in a
bounded LRU when a part was asked), framed files frame by frame (their table first, each frame
checked against its own CRC), large raw files checked once as a whole, then by range.
`sources.py` says where stored bytes come from (store, peer, image); `cache.py` holds decoded
bytes and makes concurrent requests for one file share one fetch; `bad.py` keeps the files
found bad: bytes that fail their check or decode, or a hostile catalog's entry, are EIO for
that file alone from then on, logged once with its path. A read that could not be done now
(the disk's EIO, memory, every source of a peer's file gone) fails that READ alone, logged: the
next READ tries again, since a disk or a peer may recover.

At a LOOKUP of a small file held by a peer the whole-file fetch starts at once, so its READ
joins a fetch under way. A LOOKUP is not always followed by a READ (`ls -l`, `find -size` and
`du` look files up without reading them): `LookAhead` keeps the last WINDOW remote lookups and
which of them were read, and fetching at LOOKUP stays on while most are (an exponential average
of that share of at least ON_SHARE, one step of DECAY per lookup that leaves the window). A
stat-only walk costs at most about WINDOW + 6 fetches before it stops; fetched bytes wait in
the bounded cache for their READ.

Concurrency: the trio thread only. Between two awaits the code is atomic with respect to other
tasks (trio is cooperative), which keeps the caches and frame tables consistent without locks.
Work that may take long goes to worker threads: reads that would wait for the disk and
decompressing more than INLINE_LIMIT. Small decodes run inline, because a thread hand-off
costs 60 to 140 us.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import trio

from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.image import codec
from fanfs.image.checksum import crc32
from fanfs.native import lib
from fanfs.node import pool as native
from fanfs.node.bad import BadFiles as BadFiles  # (tests/parts.py imports it from here)
from fanfs.node.cache import ByteLRU, SingleFlight
from fanfs.node.jobs import JOB_FIELDS, NativeJob
from fanfs.node.plans import Plans
from fanfs.node.pool import NativePool
from fanfs.node.sources import NOWAIT_LIMIT, WHOLE_FILE_LIMIT, Sources
from fanfs.status import ReaderStatus

log = logging.getLogger(__name__)

INLINE_LIMIT = 256 << 10  # below this, decoding runs inline (cheaper than a thread hand-off)
TABLES_KEPT = 4096  # parsed frame tables of framed files kept (LRU) ...
TABLES_BYTES = 32 << 20  # ... within this many bytes (a 1 TiB file's table alone is 24 MiB)
FRAMES_AHEAD = 2  # frames the native pool decodes ahead of a framed file read in order

Answer = bytes | memoryview | NativeJob


# -- fetches started at LOOKUP ---------------------------------------------------------------

# The front's policy (fanfs_native.h, FANFS_LA_*), one for both routes: the last WINDOW lookups
# (far more than the readers that can be between LOOKUP and READ), the share of them read
# averaged with weight DECAY, fetching at LOOKUP while it is at least ON_SHARE.
WINDOW = lib.LA_WINDOW
DECAY = 1 / lib.LA_DECAY
ON_SHARE = lib.LA_ON_SHARE / 256
SIZE_LIMIT = 4 << 20  # stored bytes of a file fetched whole at its LOOKUP, at most


class LookAhead:
    def __init__(self) -> None:
        self._recent: OrderedDict[int, bool] = OrderedDict()  # entry -> fetched at LOOKUP
        self._share = 1.0  # averaged share of remote lookups followed by a read
        self.fetched = 0
        self.used = 0  # fetched at LOOKUP, then read
        self.unused = 0  # fetched at LOOKUP, not read while in the window

    @property
    def on(self) -> bool:
        return self._share >= ON_SHARE

    def looked_up(self, entry: int, fetching: bool) -> None:
        """The kernel looked up remote file `entry`; `fetching`: its fetch starts now."""
        self._recent.pop(entry, None)
        self._recent[entry] = fetching
        self.fetched += fetching
        while len(self._recent) > WINDOW:
            _, fetched = self._recent.popitem(last=False)
            self._outcome(False, fetched)

    def waiting(self, entry: int) -> bool:
        """Whether `entry` was looked up and its READ has not come yet."""
        return entry in self._recent

    def read(self, entry: int) -> bool:
        """The kernel reads `entry`: True if its fetch started at its LOOKUP."""
        fetched = self._recent.pop(entry, None)
        if fetched is None:
            return False
        self._outcome(True, fetched)
        return fetched

    def _outcome(self, read: bool, fetched: bool) -> None:
        self._share += DECAY * (read - self._share)
        if fetched:
            self.used += read
            self.unused += not read


class Reader:
    def __init__(self, catalog: cat.Catalog, sources: Sources, cache_bytes: int,
                 bad: BadFiles, pool: NativePool, plans: Plans | None = None):  # fmt: skip
        """`pool`: asked, READ by READ, whether it runs (and decodes); `plans`: planned epochs'
        state, told of every READ and LOOKUP and holding bytes read ahead for their READ."""
        self.catalog = catalog
        self.sources = sources
        self.local = sources.local
        self.bad = bad
        self.pool = pool
        self.plans = plans
        # Decoded whole files (key: entry) and frames of framed files (key: (entry, frame)).
        self._cache = ByteLRU(cache_bytes)
        self._tables: OrderedDict[int, codec.FrameTable] = OrderedDict()
        self._tables_bytes = 0
        self._flights = SingleFlight()
        self._ahead = LookAhead()
        self._next_frame: OrderedDict[int, int] = OrderedDict()  # entry -> frame read next
        self.bytes_served = 0
        self.reads = 0

    async def read(self, entry: int, offset: int, size: int) -> Answer:
        """`size` bytes of `entry` from `offset`, or a job for the native pool. Any failure
        ends as CorruptFile for this file alone (EIO at the FUSE edge), logged once."""
        self.reads += 1
        if entry in self.bad:
            raise self.bad.refuse(entry)
        if self.plans is not None:
            held = self.plans.read(entry, offset, size)  # read ahead, waiting for this READ
            if held is not None:
                return held
        try:
            return await self._read(entry, offset, size)
        except CorruptFile:
            raise
        except Exception as e:
            raise self.bad.failed(entry, e) from None

    async def _read(self, entry: int, offset: int, size: int) -> Answer:
        length = int(self.catalog.size[entry])
        if offset >= length or size == 0:
            return b""
        size = min(size, length - offset)
        self.bytes_served += size
        codec_id = int(self.catalog.codec[entry])
        if codec_id == cat.CODEC_FRAMED:
            if self.pool.decodes and self.local.mine(entry):
                # The table first (a small read, kept parsed), then the frames in C.
                job = self._native_frames(entry, await self._table(entry), offset, size)
                if job is not None:
                    return job
            return await self._framed(entry, offset, size)
        if codec_id == cat.CODEC_RAW and length > WHOLE_FILE_LIMIT:
            data, _ = await self.sources.stored(entry, offset, size, None)
            return data
        whole = offset == 0 and size == length
        if (self.pool.running and (whole or length <= native.PARTS_LIMIT)
                and (codec_id == cat.CODEC_RAW or self.pool.decodes)):  # fmt: skip
            local = self._local_whole(entry, offset, size, codec_id)
            if local is not None:
                return local
        # A request for the whole file hands it all to the kernel, whose page cache keeps it:
        # caching it here too would only cost memory (1.35 M small files filled 900 MB).
        ahead = self._ahead.read(entry)
        data = await self._whole(entry, keep=not whole)
        if ahead and whole:
            self._cache.drop(entry)  # fetched at LOOKUP and kept for this READ: the kernel has it
        return memoryview(data)[offset : offset + size]

    def _local_whole(self, entry: int, offset: int, size: int, codec_id: int) -> Answer | None:
        """Bytes [offset, offset + size) of a file stored whole here: a small raw one's checked
        bytes if the page cache has them all (inline is cheapest), else a job for the native
        pool; None if it is not that simple (held elsewhere, cached in this daemon, or being
        fetched: the usual path shares the work)."""
        if not self.local.mine(entry) or entry in self._flights or entry in self._cache:
            return None
        c = self.catalog
        part, start = self.local.where(entry)
        length = int(c.size[entry])
        if codec_id == cat.CODEC_RAW and offset == 0 and size == length <= NOWAIT_LIMIT:
            began = time.perf_counter()
            cached = self.local.cached(part, start, length)
            if cached is not None:
                if crc32(cached) != int(c.crc[entry]):
                    self.bad.mark(entry, CorruptFile("checksum mismatch"))
                    raise self.bad.refuse(entry)
                self.local.record(began, length)  # the store counted it (pread_cached)
                return memoryview(cached)
        self.local.native(part, int(c.stored_len[entry]))
        return self.pool.whole(self.local.fd(part), self.local.dfd(part), entry, offset, size)

    def _native_frames(self, entry: int, table: codec.FrameTable, offset: int,
                       size: int) -> NativeJob | None:  # fmt: skip
        """A job for the native pool answering [offset, offset + size) of a framed file held
        here, from the frames it touches; None when Python should answer (a frame is decoded
        in this daemon's cache, or too many frames). A file read on from where its last READ
        ended (or from its start) has its next frames decoded meanwhile by idle threads."""
        fs = table.frame_size
        first, last = offset // fs, (offset + size - 1) // fs
        if any((entry, i) in self._cache for i in range(first, last + 1)):
            return None
        sequential = first == 0 or self._next_frame.get(entry) == first
        self._next_frame[entry] = last + 1
        self._next_frame.move_to_end(entry)
        while len(self._next_frame) > TABLES_KEPT:
            self._next_frame.popitem(last=False)
        ahead = (
            range(last + 1, min(len(table), last + 1 + FRAMES_AHEAD)) if sequential else range(0)
        )
        part, _ = self.local.where(entry)
        job = self.pool.frames(
            self.local.fd(part), self.local.dfd(part), entry, table, offset, size, ahead
        )
        if job is not None:
            stored = sum(job[JOB_FIELDS + 1 + 6 * k] for k in range((len(job) - JOB_FIELDS) // 6))
            self.local.native(part, stored)
        return job

    def looked_up(self, entry: int) -> None:
        """The kernel looked `entry` up: the job is there in its plan; a small file held by a
        peer starts its whole-file fetch now, while reads keep following lookups."""
        c = self.catalog
        if self.plans is not None and self.plans.shares:
            self.plans.accessed(entry, None)
        if self.sources.transport is None or not c.is_file[entry] or self.local.mine(entry):
            return
        if int(c.codec[entry]) == cat.CODEC_FRAMED or int(c.stored_len[entry]) > SIZE_LIMIT:
            return
        fetching = (self._ahead.on and entry not in self.bad and entry not in self._flights
                    and entry not in self._cache)  # fmt: skip
        self._ahead.looked_up(entry, fetching)
        if fetching:
            trio.lowlevel.spawn_system_task(self._fetch_ahead, entry)

    async def _fetch_ahead(self, entry: int) -> None:
        if not self._ahead.waiting(entry):
            return  # its READ came first (and fetched it): a second fetch would be waste
        with contextlib.suppress(Exception):  # marked bad and logged: its READ gets EIO
            await self._whole(entry, keep=True)

    def drop(self) -> None:
        """Forget every file and frame this daemon keeps decoded (cold measurements)."""
        self._cache.clear()

    def cached(self, entry: int) -> bool:
        """Whether `entry`'s decoded bytes are in this daemon's cache (not the kernel's)."""
        return entry in self._cache

    async def _once(self, key: Hashable, entry: int, lookup: Callable[[], Any],
                    produce: Callable[[], Awaitable[Any]]) -> Any:  # fmt: skip
        """`lookup()` if it has the answer, else `produce()` run by one task however many ask
        at once (cache.SingleFlight). A failure fails the waiters too (and marks `entry` bad
        if its bytes were bad)."""

        def look() -> Any:
            found = lookup()
            if found is None and entry in self.bad:
                raise self.bad.refuse(entry)
            return found

        async def guarded() -> Any:
            try:
                return await produce()
            except Exception as e:  # the disk, a codec, a hostile catalog: this file only
                raise self.bad.failed(entry, e) from None

        return await self._flights.run(key, look, guarded)

    async def _whole(self, entry: int, keep: bool = True) -> bytes:
        async def produce() -> bytes:
            c = self.catalog
            crc = int(c.crc[entry])
            stored, checked = await self.sources.stored(entry, 0, int(c.stored_len[entry]), crc)
            args = (stored, int(c.codec[entry]), int(c.size[entry]), None if checked else crc,
                    c.dicts)  # fmt: skip
            big = max(len(stored), int(c.size[entry])) > INLINE_LIMIT
            data: bytes = await self._maybe_threaded(big, codec.decode, *args)
            # Keep it if asked, or if other requests for this file wait on this fetch.
            if keep or self._flights.waiters(entry):
                self._cache.put(entry, data)
            return data

        data: bytes = await self._once(entry, entry, lambda: self._cache.get(entry), produce)
        return data

    async def _maybe_threaded(self, big: bool, fn: Any, *args: Any) -> Any:
        return await self.local.in_thread(fn, *args) if big else fn(*args)

    async def _framed(self, entry: int, offset: int, size: int) -> bytes | memoryview:
        """Bytes of a framed file: only the frames the range touches are fetched and decoded."""
        table = await self._table(entry)
        fs = table.frame_size
        pieces = []
        for i in range(offset // fs, (offset + size - 1) // fs + 1):
            frame = await self._frame(entry, table, i)
            lo = max(offset - i * fs, 0)
            pieces.append(memoryview(frame)[lo : min(offset + size - i * fs, len(frame))])
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def _table(self, entry: int) -> codec.FrameTable:
        def lookup() -> codec.FrameTable | None:
            table = self._tables.get(entry)
            if table is not None:
                self._tables.move_to_end(entry)
            return table

        async def produce() -> codec.FrameTable:
            c = self.catalog
            size, stored_len, crc = int(c.size[entry]), int(c.stored_len[entry]), int(c.crc[entry])
            off, n = codec.FrameTable.span(size, stored_len, c.frame_size)
            raw, checked = await self.sources.stored(entry, off, n, crc)
            table = codec.FrameTable(raw, size, stored_len, c.frame_size, None if checked else crc)
            self._tables[entry] = table
            self._tables_bytes += table.nbytes
            while len(self._tables) > 1 and (len(self._tables) > TABLES_KEPT
                                             or self._tables_bytes > TABLES_BYTES):  # fmt: skip
                self._tables_bytes -= self._tables.popitem(last=False)[1].nbytes
            return table

        table: codec.FrameTable = await self._once(("table", entry), entry, lookup, produce)
        return table

    async def _frame(self, entry: int, table: codec.FrameTable, i: int) -> bytes:
        key = (entry, i)

        async def produce() -> bytes:
            off, length = table.stored(i)
            stored, checked = await self.sources.stored(entry, off, length, int(table.crcs[i]))
            big = max(length, table.decoded_len(i)) > INLINE_LIMIT
            data: bytes = await self._maybe_threaded(big, table.decode, i, stored, checked)
            self._cache.put(key, data)  # the rest of the frame is likely read next
            return data

        data: bytes = await self._once(key, entry, lambda: self._cache.get(key), produce)
        return data

    def statistics(self) -> ReaderStatus:
        src, local = self.sources, self.local
        return ReaderStatus(
            reads=self.reads,
            local_fetches=local.latency.count + local.native_reads,
            cache_hits=self._cache.hits,
            bytes_fetched=local.bytes_fetched,
            bytes_served=self.bytes_served,
            cache_bytes=self._cache.size,
            cache_limit=self._cache.limit,
            bad_files=len(self.bad),
            fallbacks=src.fallbacks,
            bad_payloads=src.bad_payloads,
            native_jobs=self.pool.jobs,
            lookup_fetches=self._ahead.fetched,
            lookup_fetches_read=self._ahead.used,
            lookup_fetches_unread=self._ahead.unused,
            fetch_ms=local.latency.percentiles_ms(),
            image_ms=src.image_latency.percentiles_ms(),
            hedged=src.hedged + (src.transport.hedged if src.transport else 0),
            hedges_won=src.hedges_won + (src.transport.hedges_won if src.transport else 0),
        )
