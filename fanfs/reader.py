"""The read path: turn (entry, offset, size) into bytes, checked against the file's checksum.

Small and compressed files are fetched whole on first touch (one pread), checked, decoded and
kept in a bounded LRU cache; the kernel's page cache then holds them for later epochs. Framed
files (large ones prepared with compression) are served frame by frame: their table first, then
each frame a request touches, checked against its own CRC, decoded, and cached under
(entry, frame). Large raw files are checked once by a streaming pass, then served by direct
preads of the asked range.
A file whose bytes do not match its checksum is marked bad, logged once with its path, and every
read of it raises `CorruptFile` (EIO at the FUSE edge); all other files keep working.

This module decides how a request is answered (whole file, frame, range of a large raw file,
native job) and keeps the bad-file registry; `sources.py` says where stored bytes come from
(store, peer, image) and serves nothing but checked choices; `cache.py` holds decoded bytes and
makes concurrent requests for one file share one fetch.

Concurrency: all methods run in the trio thread. Between two awaits the code is atomic with
respect to other tasks (trio is cooperative), which is what keeps the caches, the frame tables
and `_bad` consistent without locks. Work that may take long goes to worker threads: reads
that would wait for the disk (sources.py) and decompressing or checksumming more than
256 KiB. Small decodes run inline, because a thread hand-off costs 60 to 140 us.

The native read pool: with fanfs's pyfuse3 patch (tools/install_pyfuse3.py), a request for a
whole file held here (raw and not in the page cache, or compressed), or for frames of a framed
file held here whose table is known, is not read by Python at all: `read` returns a job tuple,
and C threads in pyfuse3 read the stored bytes, check their CRC-32, decode them and answer the
kernel themselves (fanfs/native.py). That halves the daemon's CPU per cold small file (no trio
worker thread, no GIL, no wake-up of the event loop) and takes decoding off the event loop;
failures come back through `native_failed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import trio

from fanfs import catalog as cat
from fanfs import codec, filters, native
from fanfs.cache import ByteLRU, SingleFlight
from fanfs.checksum import crc32
from fanfs.errors import CorruptFile
from fanfs.lookahead import SIZE_LIMIT, LookAhead
from fanfs.native import NativeJob
from fanfs.plans import Plans
from fanfs.sources import NOWAIT_LIMIT, Sources
from fanfs.status import ReaderStatus
from fanfs.store import PartitionStore
from fanfs.transport import PeerTransport

log = logging.getLogger(__name__)

WHOLE_FILE_LIMIT = 16 << 20  # raw files up to this are fetched whole and checked at once
INLINE_LIMIT = 256 << 10  # below this, decoding runs inline (cheaper than a thread hand-off)
TABLES_KEPT = 4096  # parsed frame tables of framed files kept (LRU) ...
TABLES_BYTES = 32 << 20  # ... within this many bytes (a 1 TiB file's table alone is 24 MiB)
FRAMES_AHEAD = 2  # frames the native pool decodes ahead of a framed file read in order


class Reader:
    def __init__(
        self,
        catalog: cat.Catalog,
        store: PartitionStore,
        cache_bytes: int,
        owners: Sequence[tuple[int, ...]] | None = None,
        transport: PeerTransport | None = None,
        plans: Plans | None = None,
    ):
        """`plans`: planned epochs' state, told of every READ and LOOKUP (the job's position)
        and holding bytes read ahead until their READ."""
        self.catalog = catalog
        self.plans = plans
        self.sources = Sources(catalog, store, owners, transport)
        # Decoded whole files (key: entry) and frames of framed files (key: (entry, frame)).
        self._cache = ByteLRU(cache_bytes)
        self._tables: OrderedDict[int, codec.FrameTable] = OrderedDict()
        self._tables_bytes = 0
        self._flights = SingleFlight()
        self._verified: set[int] = set()
        self._bad: set[int] = set()
        self._ahead = LookAhead()
        self.bytes_served = 0
        self.reads = 0
        self.native = False  # the daemon sets it once pyfuse3's native read pool runs
        self.native_decodes = False  # ... and this once it decodes zstd too
        self.native_jobs = 0
        # Read-ahead of frames in the native pool (the daemon sets it): whether it was queued.
        self.native_ahead: Callable[[NativeJob], bool] | None = None
        self._next_frame: OrderedDict[int, int] = OrderedDict()  # entry -> frame read next

    async def read(self, entry: int, offset: int, size: int) -> bytes | memoryview | NativeJob:
        """`size` bytes of `entry` from `offset`, or a job for the native pool. Any failure,
        from the disk, a peer, the codec or a hostile catalog, ends as CorruptFile for this
        file alone (EIO at the FUSE edge), logged once with its path."""
        self.reads += 1
        if entry in self._bad:
            raise CorruptFile(self._describe(entry))
        if self.plans is not None:
            held = self.plans.read(entry, offset, size)  # read ahead, waiting for this READ
            if held is not None:
                return held
        try:
            return await self._read(entry, offset, size)
        except CorruptFile:
            raise
        except Exception as e:
            self._mark_bad(entry, e)
            raise CorruptFile(self._describe(entry)) from None

    async def _read(self, entry: int, offset: int, size: int) -> bytes | memoryview | NativeJob:
        length = int(self.catalog.size[entry])
        if offset >= length or size == 0:
            return b""
        size = min(size, length - offset)
        self.bytes_served += size
        codec_id = int(self.catalog.codec[entry])
        if codec_id == cat.CODEC_FRAMED:
            if self.native_decodes and self.sources.mine(entry):
                # The table first (a small read, kept parsed), then the frames in C.
                job = self._native_frames(entry, await self._table(entry), offset, size)
                if job is not None:
                    return job
            return await self._framed(entry, offset, size)
        if codec_id == cat.CODEC_RAW and length > WHOLE_FILE_LIMIT:
            # Checked once as a whole (locally), then served range by range.
            data, _ = await self.sources.stored(
                entry, offset, size, None, lambda: self._verify_large(entry)
            )
            return data
        whole = offset == 0 and size == length
        if (self.native and (whole or length <= native.PARTS_LIMIT)
                and (codec_id == cat.CODEC_RAW or self.native_decodes)):  # fmt: skip
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

    def _local_whole(
        self, entry: int, offset: int, size: int, codec_id: int
    ) -> memoryview | NativeJob | None:
        """Bytes [offset, offset + size) of a file stored whole here: a small raw one's checked
        bytes if the page cache has them all (inline is cheapest), else a job for the native
        read pool, which reads and decodes the whole file (and keeps it in its frame cache
        when the request is a part: the rest is likely asked next); None if it is not that
        simple (held elsewhere, cached in this daemon, or being fetched: the usual path shares
        the work)."""
        c, store = self.catalog, self.sources.store
        if not self.sources.mine(entry) or entry in self._flights or entry in self._cache:
            return None
        part, start, crc = int(c.part[entry]), int(c.data_off[entry]), int(c.crc[entry])
        stored_len, length = int(c.stored_len[entry]), int(c.size[entry])
        whole = offset == 0 and size == length
        if codec_id == cat.CODEC_RAW:
            kind = native.KIND_RAW
            began = time.perf_counter()
            if whole and length <= NOWAIT_LIMIT:
                cached = store.pread_cached(part, start, length)
                if cached is not None:
                    if crc32(cached) != crc:
                        self._mark_bad(entry, CorruptFile("checksum mismatch"))
                        raise CorruptFile(self._describe(entry))
                    store.count_read(part)
                    self.sources.record(began, length)
                    return memoryview(cached)
        elif codec_id in (cat.CODEC_ZSTD, cat.CODEC_ZSTD_DICT):
            kind = native.KIND_ZSTD
        elif codec_id == cat.CODEC_ZSTD_DELTA4:
            kind = native.KIND_FILTER + filters.DELTA4
        else:
            kind = native.KIND_FILTERED
        self.native_jobs += 1
        self.sources.native(part, stored_len)
        piece = (start, stored_len, crc, kind, length, 0 if whole else 1)
        return native.job(store.fd(part), entry, offset, size, [piece])

    def _native_frames(
        self, entry: int, table: codec.FrameTable, offset: int, size: int
    ) -> NativeJob | None:
        """A job for the native pool answering [offset, offset + size) of a framed file held
        here, from the frames it touches; None when Python should answer (a frame is decoded
        in this daemon's cache, or too many frames)."""
        fs = table.frame_size
        first, last = offset // fs, (offset + size - 1) // fs
        if last - first >= native.MAX_PIECES:
            return None
        if any((entry, i) in self._cache for i in range(first, last + 1)):
            return None
        part = int(self.catalog.part[entry])
        fd = self.sources.store.fd(part)
        pieces = [self._frame_piece(entry, table, i) for i in range(first, last + 1)]
        self.sources.native(part, sum(piece[1] for piece in pieces))
        self.native_jobs += 1
        # Reading on from where the last request of this file ended (or from its start): the
        # pool's other threads decode the next frames meanwhile, into its frame cache.
        sequential = first == 0 or self._next_frame.get(entry) == first
        self._next_frame[entry] = last + 1
        self._next_frame.move_to_end(entry)
        while len(self._next_frame) > TABLES_KEPT:
            self._next_frame.popitem(last=False)
        ahead = range(last + 1, min(len(table), last + 1 + FRAMES_AHEAD))
        if sequential and ahead and self.native_ahead is not None:
            for i in ahead:  # one job each, so that idle threads take them in parallel
                self.native_ahead(native.job(fd, entry, 0, 0, [self._frame_piece(entry, table, i)]))
        return native.job(fd, entry, offset - first * fs, size, pieces)

    def _frame_piece(self, entry: int, table: codec.FrameTable, i: int) -> tuple[int, ...]:
        """Frame i of a framed file as a native job's piece (kept in the frame cache)."""
        off, length = table.stored(i)
        n, fid = table.decoded_len(i), int(table.filters[i])
        kind = native.KIND_FILTER + fid if fid else (
            native.KIND_RAW if length == n else native.KIND_ZSTD)  # fmt: skip
        return (int(self.catalog.data_off[entry]) + off, length, int(table.crcs[i]), kind, n, 1)

    def looked_up(self, entry: int) -> None:
        """The kernel looked `entry` up: a small file held by a peer starts its whole-file
        fetch now, while reads keep following lookups (fanfs/lookahead.py)."""
        c = self.catalog
        if self.plans is not None and self.plans.shares:
            self.plans.accessed(entry, None)
        if self.sources.transport is None or not c.is_file[entry] or self.sources.mine(entry):
            return
        if int(c.codec[entry]) == cat.CODEC_FRAMED or int(c.stored_len[entry]) > SIZE_LIMIT:
            return
        fetching = (self._ahead.on and entry not in self._bad and entry not in self._flights
                    and entry not in self._cache)  # fmt: skip
        self._ahead.looked_up(entry, fetching)
        if fetching:
            trio.lowlevel.spawn_system_task(self._fetch_ahead, entry)

    async def _fetch_ahead(self, entry: int) -> None:
        if not self._ahead.waiting(entry):
            return  # its READ came first (and fetched it): a second fetch would be waste
        with contextlib.suppress(Exception):  # marked bad and logged: its READ gets EIO
            await self._whole(entry, keep=True)

    def mine(self, entry: int) -> bool:
        """Whether this daemon holds `entry`'s partition."""
        return self.sources.mine(entry)

    def cached(self, entry: int) -> bool:
        """Whether `entry`'s decoded bytes are in this daemon's cache (not the kernel's)."""
        return entry in self._cache

    def native_failed(self, entry: int, err: int) -> None:
        """The native pool answered EIO for `entry`: refuse it from now on, log it once."""
        self._mark_bad(entry, CorruptFile(native.failure_reason(err)))

    async def _once(
        self,
        key: Hashable,
        entry: int,
        lookup: Callable[[], Any],
        produce: Callable[[], Awaitable[Any]],
    ) -> Any:
        """`lookup()` if it has the answer, else `produce()` run by one task however many ask
        at once (cache.SingleFlight). A failure marks `entry` bad, for the waiters too."""

        def look() -> Any:
            found = lookup()
            if found is None and entry in self._bad:
                raise CorruptFile(self._describe(entry))
            return found

        async def guarded() -> Any:
            try:
                return await produce()
            except Exception as e:  # the disk, a codec, a hostile catalog: this file only
                self._mark_bad(entry, e)
                raise CorruptFile(self._describe(entry)) from None

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
        return await self.sources.in_thread(fn, *args) if big else fn(*args)

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

    async def serve(self, entry: int, offset: int, length: int) -> bytes | memoryview | None:
        """A peer's request for stored bytes of a file this daemon holds; None if it cannot."""
        c = self.catalog
        if not (0 <= entry < c.n_entries and c.is_file[entry]):
            return None
        stored_len = int(c.stored_len[entry])
        if not self.sources.mine(entry) or offset < 0 or length < 0 or offset + length > stored_len:
            return None
        try:
            if int(c.codec[entry]) == cat.CODEC_RAW and stored_len > WHOLE_FILE_LIMIT:
                await self._verify_large(entry)
            cached = self._cache.peek(entry)
            if cached is not None and int(c.codec[entry]) == cat.CODEC_RAW:
                return memoryview(cached)[offset : offset + length]
            return await self.sources.local(entry, offset, length)
        except (CorruptFile, OSError) as e:
            log.warning("cannot serve %s to a peer: %s", self._describe(entry), e)
            return None

    def locate(self, entry: int, offset: int, length: int) -> tuple[int, int] | None:
        """(partition, start) of a peer's request that a plain read of the store answers, for
        the transport's threads (transport.DirectReads); None: ask `serve`, which refuses what
        is wrong and checks a large raw file first. Safe from any thread: it reads the catalog
        (immutable) and `_verified`, which only grows."""
        c = self.catalog
        if not (0 <= entry < c.n_entries and c.is_file[entry]) or not self.sources.mine(entry):
            return None
        stored_len = int(c.stored_len[entry])
        if offset < 0 or length <= 0 or offset + length > stored_len:
            return None
        large = int(c.codec[entry]) == cat.CODEC_RAW and stored_len > WHOLE_FILE_LIMIT
        if large and entry not in self._verified:
            return None
        return int(c.part[entry]), int(c.data_off[entry]) + offset

    def pread_cached(self, part: int, offset: int, length: int) -> bytearray | None:
        return self.sources.store.pread_cached(part, offset, length)

    def pread(self, part: int, offset: int, length: int) -> bytes:
        return self.sources.store.pread(part, offset, length)

    async def _verify_large(self, entry: int) -> None:
        async def produce() -> bool:
            began = time.perf_counter()
            await self.sources.in_thread(self.sources.check_large, entry)
            self.sources.record(began, int(self.catalog.stored_len[entry]))
            self._verified.add(entry)
            return True

        await self._once(entry, entry, lambda: entry in self._verified or None, produce)

    def _mark_bad(self, entry: int, error: BaseException) -> None:
        if entry not in self._bad:
            self._bad.add(entry)
            expected = isinstance(error, (CorruptFile, OSError))
            log.error("EIO for %s: %s", self._describe(entry),
                      error if expected else f"{type(error).__name__}: {error}",
                      exc_info=not expected)  # fmt: skip

    def _describe(self, entry: int) -> str:
        return os.fsdecode(b"/" + self.catalog.path(entry))

    def statistics(self) -> ReaderStatus:
        src = self.sources
        return ReaderStatus(
            reads=self.reads,
            local_fetches=src.latency.count + src.native_reads,
            cache_hits=self._cache.hits,
            bytes_fetched=src.bytes_fetched,
            bytes_served=self.bytes_served,
            cache_bytes=self._cache.size,
            cache_limit=self._cache.limit,
            bad_files=len(self._bad),
            fallbacks=src.fallbacks,
            bad_payloads=src.bad_payloads,
            native_jobs=self.native_jobs,
            lookup_fetches=self._ahead.fetched,
            lookup_fetches_read=self._ahead.used,
            lookup_fetches_unread=self._ahead.unused,
            fetch_ms=src.latency.percentiles_ms(),
        )
