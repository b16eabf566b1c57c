"""The read path: turn (entry, offset, size) into bytes, checked against the file's checksum.

Small and compressed files are fetched whole on first touch (one pread), checked, decoded and
kept in a bounded LRU cache; the kernel's page cache then holds them for later epochs. Framed
files (large ones prepared with compression) are served frame by frame: their table first, then
each frame a request touches, checked against its own CRC, decoded, and cached under
(entry, frame). Large raw files are checked once by a streaming pass, then served by direct
preads of the asked range.
A file whose bytes do not match its checksum is marked bad, logged once with its path, and every
read of it raises `CorruptFile` (EIO at the FUSE edge); all other files keep working.

Concurrency: all methods run in the trio thread. Between two awaits the code is atomic with
respect to other tasks (trio is cooperative), which is what keeps `_cache`, `_tables`,
`_inflight` and `_bad` consistent without locks. Work that may take long goes to worker threads
under a CapacityLimiter: reads that would wait for the disk (detected with preadv2(RWF_NOWAIT),
which fails at once instead of blocking) and decompressing or checksumming more than 256 KiB.
Reads the page cache can answer, and small decodes, run inline, because a thread hand-off costs
60 to 140 us, more than copying a small file from the page cache.

The native read pool: with fanfs's pyfuse3 patch (tools/install_pyfuse3.py), a request for a
whole raw file held here whose bytes are not in the page cache is not read by Python at all:
`read` returns a job tuple, and C threads in pyfuse3 read the bytes, check their CRC-32 and
answer the kernel themselves. That halves the daemon's CPU per cold small file (no trio worker
thread, no GIL, no wake-up of the event loop); failures come back through `native_failed`.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import numpy as np
import trio

from fanfs import catalog as cat
from fanfs import codec
from fanfs.errors import CorruptFile
from fanfs.latency import Latencies
from fanfs.store import PartitionStore
from fanfs.transport import PeerTimeout, Transport

log = logging.getLogger(__name__)

WHOLE_FILE_LIMIT = 16 << 20  # raw files up to this are fetched whole and checked at once
INLINE_LIMIT = 256 << 10  # below this, decoding runs inline (cheaper than a thread hand-off)
# Reads of up to this many bytes that the page cache holds run inline; disk reads go to threads.
NOWAIT_LIMIT = 1 << 20
VERIFY_CHUNK = 8 << 20
WORKER_THREADS = 4  # concurrent big reads/decodes; more would only contend for 2 cores here
ENTRY_OVERHEAD = 120  # bytes a cache entry costs beyond its data (dict slot, bytes header)
TABLES_KEPT = 4096  # parsed frame tables of framed files kept (LRU)

# (fd, offset, length, crc, entry, skip, count): a whole file for pyfuse3's native read pool
# to read, check against `crc` and answer with bytes [skip, skip + count) of it.
NativeJob = tuple[int, int, int, int, int, int, int]


class Reader:
    def __init__(
        self,
        catalog: cat.Catalog,
        store: PartitionStore,
        cache_bytes: int,
        owners: Sequence[tuple[int, ...]] | None = None,
        transport: Transport | None = None,
    ):
        self.catalog = catalog
        self.store = store
        self.transport = transport
        self.rank = transport.rank if transport is not None else 0
        # owners[p]: ranks holding partition p; without a transport this daemon holds all.
        self.owners = owners if transport is not None and owners is not None else None
        if self.owners is None:
            self._mine = np.ones(catalog.n_partitions, dtype=bool)
        else:
            self._mine = np.array([self.rank in o for o in self.owners], dtype=bool)
        self.cache_bytes = cache_bytes
        # Decoded whole files (key: entry) and frames of framed files (key: (entry, frame)).
        self._cache: OrderedDict[Hashable, bytes] = OrderedDict()
        self._cached = 0
        self._tables: OrderedDict[int, codec.FrameTable] = OrderedDict()
        self._inflight: dict[Hashable, trio.Event] = {}
        self._verified: set[int] = set()
        self._bad: set[int] = set()
        self._limiter = trio.CapacityLimiter(WORKER_THREADS)
        self._latency = Latencies()  # of local fetches
        self.cache_hits = 0
        self.bytes_fetched = 0
        self.bytes_served = 0
        self.reads = 0
        self.fallbacks = 0
        self.bad_payloads = 0
        self.native = False  # the daemon sets it once pyfuse3's native read pool runs
        self.native_jobs = 0

    async def read(self, entry: int, offset: int, size: int) -> bytes | memoryview | NativeJob:
        """`size` bytes of `entry` from `offset`, or a job for the native pool. Any failure,
        from the disk, a peer, the codec or a hostile catalog, ends as CorruptFile for this
        file alone (EIO at the FUSE edge), logged once with its path."""
        self.reads += 1
        if entry in self._bad:
            raise CorruptFile(self._describe(entry))
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
            return await self._framed(entry, offset, size)
        if codec_id == cat.CODEC_RAW and length > WHOLE_FILE_LIMIT:
            if not self._mine[int(self.catalog.part[entry])]:
                got = await self._remote(entry, offset, size, None)
                if got is not None:
                    return got
                self.fallbacks += 1
            await self._verify_large(entry)
            return await self._read_stored(entry, offset, size)
        if self.native and codec_id == cat.CODEC_RAW and offset == 0 and size == length:
            local = self._local_whole(entry, length)
            if local is not None:
                return local
        # A request for the whole file hands it all to the kernel, whose page cache keeps it:
        # caching it here too would only cost memory (1.35 M small files filled 900 MB).
        data = await self._whole(entry, keep=offset > 0 or size < length)
        return memoryview(data)[offset : offset + size]

    def _local_whole(self, entry: int, length: int) -> memoryview | NativeJob | None:
        """A whole raw file held here: its checked bytes if the page cache has them (inline is
        cheapest), else a job for the native read pool; None if it is not that simple (held
        elsewhere, cached in this daemon, or being fetched: the usual path shares the work)."""
        c = self.catalog
        part = int(c.part[entry])
        if not self._mine[part] or entry in self._inflight or entry in self._cache:
            return None
        start, crc = int(c.data_off[entry]), int(c.crc[entry])
        began = time.perf_counter()
        if length <= NOWAIT_LIMIT:
            cached = self.store.pread_cached(part, start, length)
            if cached is not None:
                if zlib.crc32(cached) != crc:
                    self._mark_bad(entry, CorruptFile("checksum mismatch"))
                    raise CorruptFile(self._describe(entry))
                self._record(began, length)
                return memoryview(cached)
        self.native_jobs += 1
        self.bytes_fetched += length
        return (self.store.fd(part), start, length, crc, entry, 0, length)

    def native_failed(self, entry: int, err: int) -> None:
        """The native pool answered EIO for `entry`: refuse it from now on, log it once."""
        why = "checksum mismatch" if err == errno.EBADMSG else os.strerror(err)
        self._mark_bad(entry, CorruptFile(why))

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def _shared(self, key: Hashable) -> trio.Event | None:
        """Wait for another task's fetch of `key`; None if the caller should fetch."""
        event = self._inflight.get(key)
        if event is None:
            self._inflight[key] = trio.Event()
            return None
        await event.wait()
        return event

    def _waiters(self, key: Hashable) -> int:
        return self._inflight[key].statistics().tasks_waiting

    async def _once(
        self,
        key: Hashable,
        entry: int,
        lookup: Callable[[], Any],
        produce: Callable[[], Awaitable[Any]],
    ) -> Any:
        """`lookup()` if it has the answer, else `produce()` run by one task however many
        ask at once (the others wait, then look again). A failure marks `entry` bad."""
        while True:
            found = lookup()
            if found is not None:
                return found
            if entry in self._bad:
                raise CorruptFile(self._describe(entry))
            if await self._shared(key) is None:
                break
        try:
            return await produce()
        except Exception as e:  # the disk, a codec, a hostile catalog: this file only
            self._mark_bad(entry, e)
            raise CorruptFile(self._describe(entry)) from None
        finally:
            self._inflight.pop(key).set()

    def _lookup(self, key: Hashable) -> bytes | None:
        data = self._cache.get(key)
        if data is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
        return data

    async def _whole(self, entry: int, keep: bool = True) -> bytes:
        async def produce() -> bytes:
            c = self.catalog
            stored = await self._stored(entry, 0, int(c.stored_len[entry]), int(c.crc[entry]))
            args = (stored, int(c.codec[entry]), int(c.size[entry]), int(c.crc[entry]), c.dicts)
            big = max(len(stored), int(c.size[entry])) > INLINE_LIMIT
            data: bytes = await self._maybe_threaded(big, codec.decode, *args)
            # Keep it if asked, or if other requests for this file wait on this fetch.
            if keep or self._waiters(entry):
                self._put(entry, data)
            return data

        data: bytes = await self._once(entry, entry, lambda: self._lookup(entry), produce)
        return data

    async def _maybe_threaded(self, big: bool, fn: Any, *args: Any) -> Any:
        return await self._in_thread(fn, *args) if big else fn(*args)

    async def _stored(self, entry: int, offset: int, length: int, crc: int | None) -> bytes:
        """Stored bytes of `entry`: from this daemon's store, or a peer (checked against `crc`
        when given, so a bad copy sends us to the next source), or the image as a last resort."""
        if not self._mine[int(self.catalog.part[entry])]:
            got = await self._remote(entry, offset, length, crc)
            if got is not None:
                return got
            self.fallbacks += 1  # no peer could: read the image (shared storage)
        began = time.perf_counter()
        data = await self._read_stored(entry, offset, length)
        self._record(began, length)
        return data

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
            raw = await self._stored(entry, off, n, crc)
            table = codec.FrameTable(raw, size, stored_len, c.frame_size, crc)
            self._tables[entry] = table
            while len(self._tables) > TABLES_KEPT:
                self._tables.popitem(last=False)
            return table

        table: codec.FrameTable = await self._once(("table", entry), entry, lookup, produce)
        return table

    async def _frame(self, entry: int, table: codec.FrameTable, i: int) -> bytes:
        key = (entry, i)

        async def produce() -> bytes:
            off, length = table.stored(i)
            stored = await self._stored(entry, off, length, int(table.crcs[i]))
            big = max(length, table.decoded_len(i)) > INLINE_LIMIT
            data: bytes = await self._maybe_threaded(big, table.decode, i, stored)
            self._put(key, data)  # the rest of the frame is likely read next
            return data

        data: bytes = await self._once(key, entry, lambda: self._lookup(key), produce)
        return data

    def _sources(self, entry: int) -> list[int]:
        """Peers holding `entry`, live ones only, rotated per file to spread load over replicas."""
        assert self.owners is not None and self.transport is not None
        ranks = self.owners[int(self.catalog.part[entry])]
        k = entry % len(ranks)
        ranks = ranks[k:] + ranks[:k]
        return [r for r in ranks if r != self.rank and not self.transport.is_dead(r)]

    async def _remote(self, entry: int, offset: int, length: int, crc: int | None) -> bytes | None:
        """Stored bytes of `entry` from the first peer that has them, or None. With `crc`,
        a reply that does not match it is a bad copy: the next peer is tried."""
        assert self.transport is not None
        for peer in self._sources(entry):
            try:
                stored = await self.transport.fetch(peer, entry, offset, length)
            except PeerTimeout:
                continue
            if stored is None:
                continue
            if crc is None or zlib.crc32(stored) == crc:
                return stored
            self.bad_payloads += 1
            log.warning("bad payload for %s from rank %d, trying another source",
                        self._describe(entry), peer)  # fmt: skip
        return None

    async def serve(self, entry: int, offset: int, length: int) -> bytes | memoryview | None:
        """A peer's request for stored bytes of a file this daemon holds; None if it cannot."""
        c = self.catalog
        if not (0 <= entry < c.n_entries and c.is_file[entry]):
            return None
        part, stored_len = int(c.part[entry]), int(c.stored_len[entry])
        if not self._mine[part] or offset < 0 or length < 0 or offset + length > stored_len:
            return None
        try:
            if int(c.codec[entry]) == cat.CODEC_RAW and stored_len > WHOLE_FILE_LIMIT:
                await self._verify_large(entry)
            cached = self._cache.get(entry)
            if cached is not None and int(c.codec[entry]) == cat.CODEC_RAW:
                return memoryview(cached)[offset : offset + length]
            return await self._read_stored(entry, offset, length)
        except (CorruptFile, OSError) as e:
            log.warning("cannot serve %s to a peer: %s", self._describe(entry), e)
            return None

    async def _read_stored(self, entry: int, offset: int, length: int) -> bytes:
        """Stored bytes from the local store: inline from the page cache, else in a thread
        (a read that waits for the disk never blocks the event loop)."""
        part = int(self.catalog.part[entry])
        start = int(self.catalog.data_off[entry]) + offset
        if length <= NOWAIT_LIMIT:
            cached = self.store.pread_cached(part, start, length)
            if cached is not None:
                return cached  # type: ignore[return-value]
        data: bytes = await self._in_thread(self.store.pread, part, start, length)
        return data

    async def _verify_large(self, entry: int) -> None:
        async def produce() -> bool:
            began = time.perf_counter()
            await self._in_thread(self._check_large, entry)
            self._record(began, int(self.catalog.stored_len[entry]))
            self._verified.add(entry)
            return True

        await self._once(entry, entry, lambda: entry in self._verified or None, produce)

    def _check_large(self, entry: int) -> None:
        c = self.catalog
        part, start, length = int(c.part[entry]), int(c.data_off[entry]), int(c.stored_len[entry])
        crc = 0
        for off in range(0, length, VERIFY_CHUNK):
            crc = zlib.crc32(
                self.store.pread(part, start + off, min(VERIFY_CHUNK, length - off)), crc
            )
        if crc != int(c.crc[entry]):
            raise CorruptFile("checksum mismatch")

    def _put(self, key: Hashable, data: bytes) -> None:
        self._cache[key] = data
        self._cached += len(data) + ENTRY_OVERHEAD
        # Evict least recently used, but keep the newest entry even if it alone is too big:
        # the request that fetched it must still be answered.
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old) + ENTRY_OVERHEAD

    def _record(self, began: float, nbytes: int) -> None:
        self._latency.record(time.perf_counter() - began)
        self.bytes_fetched += nbytes

    def _mark_bad(self, entry: int, error: BaseException) -> None:
        if entry not in self._bad:
            self._bad.add(entry)
            expected = isinstance(error, (CorruptFile, OSError))
            log.error("EIO for %s: %s", self._describe(entry),
                      error if expected else f"{type(error).__name__}: {error}",
                      exc_info=not expected)  # fmt: skip

    def _describe(self, entry: int) -> str:
        return os.fsdecode(b"/" + self.catalog.path(entry))

    def statistics(self) -> dict[str, Any]:
        return {
            "reads": self.reads,
            "local_fetches": self._latency.count,
            "cache_hits": self.cache_hits,
            "bytes_fetched": self.bytes_fetched,
            "bytes_served": self.bytes_served,
            "cache_bytes": self._cached,
            "cache_limit": self.cache_bytes,
            "bad_files": len(self._bad),
            "fallbacks": self.fallbacks,
            "bad_payloads": self.bad_payloads,
            "native_jobs": self.native_jobs,
            **self._latency.percentiles_ms("fetch_ms"),
        }
