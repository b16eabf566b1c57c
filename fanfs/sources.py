"""Where a file's stored bytes come from: this daemon's store, a peer, or the image, chosen here.

`stored()` is the one source choice: a file this daemon holds is read from its store (the
staged copy, or the image until staged); any other file is asked of its holders in turn (live
ones only, rotated per file to spread load over replicas) and, when none can answer, read from
the image on shared storage. A peer's reply is checked against the CRC the caller gives, so a
bad copy sends the reader to the next source; the caller is told that the bytes are checked and
does not check them again.

Local reads never block the event loop on the disk: preadv2(RWF_NOWAIT) answers from the page
cache inline or fails at once, and only reads that would wait go to a worker thread (a hand-off
costs 60 to 140 us, more than copying a small file from the page cache).

`stored_blocking` is the same choice for threads of the daemon's own (the read-ahead engine's):
it blocks, asking peers through the transport's blocking fetch where it has one, else through
the event loop.

Concurrency: `stored` and the other async methods run in the trio thread, their blocking reads
in worker threads under one limiter; `stored_blocking` in any other thread. Counters shared by
both sides change under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import trio

from fanfs import catalog as cat
from fanfs import codec
from fanfs.checksum import crc32
from fanfs.errors import CorruptFile
from fanfs.latency import Latencies
from fanfs.store import PartitionStore
from fanfs.transport import PeerTimeout, PeerTransport

log = logging.getLogger(__name__)

# Reads of up to this many bytes that the page cache holds run inline; disk reads go to threads.
NOWAIT_LIMIT = 1 << 20
WORKER_THREADS = 4  # concurrent big reads/decodes; more would only contend for 2 cores here


class Sources:
    def __init__(
        self,
        catalog: cat.Catalog,
        store: PartitionStore,
        owners: Sequence[tuple[int, ...]] | None = None,
        transport: PeerTransport | None = None,
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
        self._limiter = trio.CapacityLimiter(WORKER_THREADS)
        self.latency = Latencies()  # of local fetches
        self._count = threading.Lock()
        self.bytes_fetched = 0
        self.fallbacks = 0
        self.bad_payloads = 0
        self.native_reads = 0  # local fetches the native pool did (not in `latency`)

    def mine(self, entry: int) -> bool:
        """Whether this daemon holds `entry`'s partition."""
        return bool(self._mine[int(self.catalog.part[entry])])

    async def in_thread(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def stored(
        self,
        entry: int,
        offset: int,
        length: int,
        crc: int | None,
        before_local: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[bytes, bool]:
        """(`length` stored bytes of `entry` from `offset`, whether they were checked against
        `crc` already). Local bytes are not: the decoder checks them, in a thread when big.
        `before_local` runs before a local read (a large raw file's one-time check)."""
        if not self.mine(entry):
            got = await self.remote(entry, offset, length, crc)
            if got is not None:
                return got, crc is not None
            self._fell_back()  # no peer could: read the image (shared storage)
        if before_local is not None:
            await before_local()
        began = time.perf_counter()
        data = await self.local(entry, offset, length)
        self.record(began, length)
        return data, False

    def stored_blocking(self, entry: int, offset: int, length: int, crc: int | None,
                        token: trio.lowlevel.TrioToken) -> tuple[bytes, bool]:  # fmt: skip
        """`stored` for a thread of the daemon's own (never the event loop's): peers through
        the transport's blocking fetch when it has one, else through the event loop (`token`)."""
        if not self.mine(entry):
            if self.transport is not None and self.transport.blocking_fetch:
                got = self._remote_blocking(entry, offset, length, crc)
            else:
                got = trio.from_thread.run(self.remote, entry, offset, length, crc,
                                           trio_token=token)  # fmt: skip
            if got is not None:
                return got, crc is not None
            self._fell_back()
        part = int(self.catalog.part[entry])
        start = int(self.catalog.data_off[entry]) + offset
        began = time.perf_counter()
        data = self.store.pread(part, start, length)
        self.record(began, length)
        return data, False

    def _remote_blocking(self, entry: int, offset: int, length: int,
                         crc: int | None) -> bytes | None:  # fmt: skip
        assert self.transport is not None
        for peer in self.peers(entry):
            try:
                stored = self.transport.fetch_blocking(peer, entry, offset, length)
            except PeerTimeout:
                continue
            if stored is not None and self._good(entry, peer, stored, crc):
                return stored
        return None

    def advise(self, entry: int) -> None:
        """Ask the kernel to start reading a file this daemon holds (never waits for it)."""
        if self.mine(entry):
            part = int(self.catalog.part[entry])
            with contextlib.suppress(OSError):
                os.posix_fadvise(
                    self.store.fd(part),
                    int(self.catalog.data_off[entry]),
                    int(self.catalog.stored_len[entry]),
                    os.POSIX_FADV_WILLNEED,
                )

    def _fell_back(self) -> None:
        with self._count:
            self.fallbacks += 1

    def _good(self, entry: int, peer: int, stored: bytes, crc: int | None) -> bool:
        """Whether a peer's reply matches its CRC; a bad copy is counted and logged."""
        if crc is None or crc32(stored) == crc:
            return True
        with self._count:
            self.bad_payloads += 1
        log.warning("bad payload for %s from rank %d, trying another source",
                    os.fsdecode(b"/" + self.catalog.path(entry)), peer)  # fmt: skip
        return False

    def peers(self, entry: int) -> list[int]:
        """Peers holding `entry`, live ones only, rotated per file to spread load over replicas."""
        assert self.owners is not None and self.transport is not None
        ranks = self.owners[int(self.catalog.part[entry])]
        k = entry % len(ranks)
        ranks = ranks[k:] + ranks[:k]
        return [r for r in ranks if r != self.rank and not self.transport.is_dead(r)]

    async def remote(self, entry: int, offset: int, length: int, crc: int | None) -> bytes | None:
        """Stored bytes of `entry` from the first peer that has them, or None. With `crc`,
        a reply that does not match it is a bad copy: the next peer is tried."""
        assert self.transport is not None
        for peer in self.peers(entry):
            try:
                stored = await self.transport.fetch(peer, entry, offset, length)
            except PeerTimeout:
                continue
            if stored is not None and self._good(entry, peer, stored, crc):
                return stored
        return None

    async def local(self, entry: int, offset: int, length: int) -> bytes:
        """Stored bytes from the local store: inline from the page cache, else in a thread."""
        part = int(self.catalog.part[entry])
        start = int(self.catalog.data_off[entry]) + offset
        if length <= NOWAIT_LIMIT:
            cached = self.store.pread_cached(part, start, length)
            if cached is not None:
                return cached  # type: ignore[return-value]
        data: bytes = await self.in_thread(self.store.pread, part, start, length)
        return data

    def check_large(self, entry: int) -> None:
        """Check a large raw file's CRC by streaming it from the store (blocking: a thread's)."""
        c = self.catalog
        part, start, length = int(c.part[entry]), int(c.data_off[entry]), int(c.stored_len[entry])
        got = codec.streamed_crc(lambda off, n: self.store.pread(part, off, n), start, length)
        if got != int(c.crc[entry]):
            raise CorruptFile("checksum mismatch")

    def record(self, began: float, nbytes: int) -> None:
        elapsed = time.perf_counter() - began
        with self._count:
            self.latency.record(elapsed)
            self.bytes_fetched += nbytes

    def native(self, part: int, nbytes: int) -> None:
        """A read handed to the native pool (fanfs/native.py): counted as a local fetch (of
        the image, if the partition is not staged yet), its time is the pool's."""
        self.store.count_read(part)
        with self._count:
            self.native_reads += 1
            self.bytes_fetched += nbytes
