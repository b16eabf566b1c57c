"""Where a file's stored bytes come from: this daemon's store, a peer, or the image, chosen here.

`Local` is every read of this daemon's own stored bytes: its store (the staged copy, or the
image until staged), inline when the page cache holds them (preadv2(RWF_NOWAIT) answers from
the page cache or fails at once) and in a worker thread when they would wait for the disk (a
hand-off costs 60 to 140 us, more than copying a small file from the page cache); the check
of a large raw file, once, as a whole; the counters of local fetches. The peer server
(`PeerServer`, below) and `Sources` both read through it.

`PeerServer` is what a peer may ask of this daemon: stored bytes of a file it holds, answered
through `Local`. A request (entry, offset, length) is refused (None) unless the entry is a
file this daemon holds and the range lies within its stored bytes; a large raw file is checked
once as a whole before any range of it is served. The transport is handed the server: requests
a plain read answers go to `locate` and the reads (`cached`, `pread`), which the MPI
transport's own threads call without the event loop; the rest to `serve` in the event loop.
The server knows neither the transport nor the Reader.

`Sources.stored()` is the one source choice: a file this daemon holds is read locally; any
other file is asked of its holders (fanfs/node/peers.py, the one owner of which peer to ask,
in which order, and what to do after a bad copy or a slow holder) and, when none can answer,
read from the image on shared storage. A peer's reply is checked against the CRC the caller
gives, so the caller is told that the bytes are checked and does not check them again.
`stored_blocking` is the same choice for threads of the daemon's own (the read-ahead engine's):
it blocks, asking peers through the transport's blocking fetch where it has one, else through
the event loop.

Concurrency: the async methods run in the trio thread, their blocking reads in worker threads
under one limiter; the blocking ones in any other thread (the peer server's `locate`, `cached`
and `pread` too: the catalog is immutable, the set of checked large files only grows).
Counters change under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.image import codec
from fanfs.node.cache import Latencies, SingleFlight
from fanfs.node.peers import Peers
from fanfs.node.store import PartitionStore
from fanfs.node.transport import PeerTransport

log = logging.getLogger(__name__)

# Reads of up to this many bytes that the page cache holds run inline; disk reads go to threads.
NOWAIT_LIMIT = 1 << 20
WORKER_THREADS = 4  # concurrent big reads/decodes; more would only contend for 2 cores here
# Raw files up to this are fetched whole and checked at once; larger ones are checked once as a
# whole (streamed), then served range by range.
WHOLE_FILE_LIMIT = 16 << 20


class Local:
    def __init__(self, catalog: cat.Catalog, store: PartitionStore, mine: np.ndarray):
        """`mine[p]`: whether this daemon holds partition p."""
        self.catalog = catalog
        self.store = store
        self._mine = mine
        self._limiter = trio.CapacityLimiter(WORKER_THREADS)
        self._verified: set[int] = set()  # large raw files checked whole (only grows)
        # ... checked on the image before their partition was local: checked again once it is
        # (a staged or adopted copy is other bytes than the ones checked)
        self._verified_image: set[int] = set()
        self._checking = SingleFlight()
        self.latency = Latencies()  # of local fetches in Python
        self._count = threading.Lock()
        self.bytes_fetched = 0
        self.native_reads = 0  # local fetches the native pool did (not in `latency`)

    def mine(self, entry: int) -> bool:
        """Whether this daemon holds `entry`'s partition."""
        return bool(self._mine[int(self.catalog.part[entry])])

    def where(self, entry: int, offset: int = 0) -> tuple[int, int]:
        """(partition, offset in it) of `entry`'s stored byte `offset`."""
        return int(self.catalog.part[entry]), int(self.catalog.data_off[entry]) + offset

    def large(self, entry: int) -> bool:
        """A raw file checked once as a whole, then served by range."""
        c = self.catalog
        return int(c.codec[entry]) == cat.CODEC_RAW and int(c.stored_len[entry]) > WHOLE_FILE_LIMIT

    async def in_thread(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def read(self, entry: int, offset: int, length: int, count: bool = True) -> bytes:
        """Stored bytes from the store: inline from the page cache, else in a thread.
        `count`: a fetch of this daemon's own (not a peer's)."""
        part, start = self.where(entry, offset)
        began = time.perf_counter()
        data = self.cached(part, start, length) if length <= NOWAIT_LIMIT else None
        if data is None:
            data = await self.in_thread(self.store.pread, part, start, length)
        if count:
            self.record(began, length)
        return data  # type: ignore[return-value]

    def read_blocking(self, entry: int, offset: int, length: int) -> bytes:
        part, start = self.where(entry, offset)
        began = time.perf_counter()
        data = self.store.pread(part, start, length)
        self.record(began, length)
        return data

    def cached(self, part: int, start: int, length: int) -> bytearray | None:
        """The bytes if the page cache holds them all (never waits for the disk), else None."""
        return self.store.pread_cached(part, start, length)

    def pread(self, part: int, start: int, length: int) -> bytes:
        """Exactly the bytes (may wait for the disk; OSError on failure)."""
        return self.store.pread(part, start, length)

    def fd(self, part: int) -> int:
        return self.store.fd(part)

    def dfd(self, part: int) -> int:
        """The partition's staged copy opened O_DIRECT, or -1 (fanfs/node/store.py)."""
        return self.store.dfd(part)

    def staged(self, part: int) -> bool:
        return self.store.staged(part)

    def advise(self, entry: int) -> None:
        """Ask the kernel to start reading a file this daemon holds (never waits for it)."""
        if self.mine(entry):
            part, start = self.where(entry)
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.store.fd(part), start, int(self.catalog.stored_len[entry]),
                                 os.POSIX_FADV_WILLNEED)  # fmt: skip

    def is_verified(self, entry: int) -> bool:
        """Whether a large raw file passed its check in the copy it is read from now (safe
        from any thread: the sets only grow)."""
        if entry in self._verified:
            return True
        return entry in self._verified_image and not self.store.staged(self.where(entry)[0])

    async def verify(self, entry: int) -> None:
        """Check a large raw file's CRC once, as a whole (streamed in a thread); CorruptFile
        if it fails. Concurrent callers share one check."""

        async def check() -> bool:
            began = time.perf_counter()
            local = self.store.staged(self.where(entry)[0])
            await self.in_thread(self._check_large, entry)
            self.record(began, int(self.catalog.stored_len[entry]))
            (self._verified if local else self._verified_image).add(entry)
            return True

        await self._checking.run(entry, lambda: self.is_verified(entry) or None, check)

    def _check_large(self, entry: int) -> None:
        part, start = self.where(entry)
        length = int(self.catalog.stored_len[entry])
        got = codec.streamed_crc(lambda off, n: self.store.pread(part, off, n), start, length)
        if got != int(self.catalog.crc[entry]):
            raise CorruptFile("checksum mismatch")

    def record(self, began: float, nbytes: int) -> None:
        elapsed = time.perf_counter() - began
        with self._count:
            self.latency.record(elapsed)
            self.bytes_fetched += nbytes

    def native(self, part: int, nbytes: int) -> None:
        """A read handed to the native pool: counted as a local fetch (of the image, if the
        partition is not staged yet); its time is the pool's."""
        self.store.count_read(part, nbytes)
        with self._count:
            self.native_reads += 1
            self.bytes_fetched += nbytes


class PeerServer:
    def __init__(self, catalog: cat.Catalog, local: Local):
        self.catalog = catalog
        self.local = local

    def _valid(self, entry: int, offset: int, length: int) -> bool:
        c = self.catalog
        if not (0 <= entry < c.n_entries and c.is_file[entry]) or not self.local.mine(entry):
            return False
        return offset >= 0 and length > 0 and offset + length <= int(c.stored_len[entry])

    async def serve(self, entry: int, offset: int, length: int) -> bytes | None:
        """The stored bytes a peer asked for, or None if this daemon cannot serve them."""
        if not self._valid(entry, offset, length):
            return None
        try:
            if self.local.large(entry):
                await self.local.verify(entry)
            return await self.local.read(entry, offset, length, count=False)
        except (CorruptFile, OSError) as e:
            log.warning("cannot serve /%s to a peer: %s", self.catalog.path(entry).decode(
                errors="replace"), e)  # fmt: skip
            return None

    def locate(self, entry: int, offset: int, length: int) -> tuple[int, int] | None:
        """(partition, start) of a request a plain read answers, or None: `serve` refuses what
        is wrong and checks a large raw file first."""
        if not self._valid(entry, offset, length):
            return None
        if self.local.large(entry) and not self.local.is_verified(entry):
            return None
        return self.local.where(entry, offset)

    def cached(self, part: int, start: int, length: int) -> bytearray | None:
        """The bytes if the page cache holds them all (never waits for the disk), else None."""
        return self.local.cached(part, start, length)

    def whole(self, entry: int) -> tuple[int, int, int] | None:
        """(partition, start, stored length) of a file's whole stored bytes when a plain read
        answers them, or None."""
        if not 0 <= entry < self.catalog.n_entries:
            return None
        length = int(self.catalog.stored_len[entry])
        located = self.locate(entry, 0, length)
        return None if located is None else (*located, length)

    def pread(self, part: int, start: int, length: int) -> bytes:
        """Exactly the bytes (may wait for the disk; OSError on failure)."""
        return self.local.pread(part, start, length)


class Sources:
    def __init__(
        self,
        catalog: cat.Catalog,
        local: Local,
        owners: Sequence[tuple[int, ...]] | None = None,
        transport: PeerTransport | None = None,
    ):
        """`owners[p]`: the ranks holding partition p (with a transport)."""
        self.catalog = catalog
        self.local = local
        self.transport = transport
        # Which peers to ask, in which order, and the next after a failure: fanfs/node/peers.py.
        self._peers = (Peers(catalog, owners, transport)
                       if transport is not None and owners is not None else None)  # fmt: skip
        self._count = threading.Lock()
        self.fallbacks = 0
        self.image_latency = Latencies()  # reads of the image when no peer could answer

    def mine(self, entry: int) -> bool:
        return self.local.mine(entry)

    @property
    def bad_payloads(self) -> int:
        return self._peers.bad_payloads if self._peers else 0

    @property
    def hedged(self) -> int:
        """Fetches asked of a second holder because the first was slow."""
        return self._peers.hedged if self._peers else 0

    @property
    def hedges_won(self) -> int:
        """... that the second holder answered first."""
        return self._peers.hedges_won if self._peers else 0

    async def stored(self, entry: int, offset: int, length: int,
                     crc: int | None) -> tuple[bytes, bool]:  # fmt: skip
        """(`length` stored bytes of `entry` from `offset`, whether they were checked against
        `crc` already). Local bytes are not: the decoder checks them, in a thread when big. A
        large raw file read locally is checked once as a whole first."""
        if not self.mine(entry):
            got = await self.remote(entry, offset, length, crc)
            if got is not None:
                return got, crc is not None
            # No peer could: read the image (shared storage).
            began = time.perf_counter()
            if self.local.large(entry):
                await self.local.verify(entry)
            data = await self.local.read(entry, offset, length, count=False)
            self._fell_back(began)
            return data, False
        if self.local.large(entry):
            await self.local.verify(entry)
        return await self.local.read(entry, offset, length), False

    def stored_blocking(self, entry: int, offset: int, length: int, crc: int | None,
                        token: trio.lowlevel.TrioToken) -> tuple[bytes, bool]:  # fmt: skip
        """`stored` for a thread of the daemon's own (never the event loop's) and for files
        read whole (no large raw file): peers through the transport's blocking fetch when it
        has one, else through the event loop (`token`)."""
        if not self.mine(entry):
            if self._peers is None:
                got = None
            elif self._peers.transport.blocking_fetch:
                got = self._peers.get_blocking(entry, offset, length, crc)
            else:
                got = trio.from_thread.run(self.remote, entry, offset, length, crc,
                                           trio_token=token)  # fmt: skip
            if got is not None:
                return got, crc is not None
            began = time.perf_counter()
            data = self.local.store.pread(*self.local.where(entry, offset), length)
            self._fell_back(began)
            return data, False
        return self.local.read_blocking(entry, offset, length), False

    @property
    def batches(self) -> bool:
        """Whether whole files can be fetched from a peer several at a time (`batch_blocking`)."""
        return self.transport is not None and self.transport.batches

    @property
    def plane(self) -> bool:
        """Whether the data plane (C, both sides) fetches peers' small files (the planner's
        through the native pool, `fanfs_pool_push_file`)."""
        return self.transport is not None and self.transport.plane_fetches

    def batch_blocking(self, peer: int, entries: list[int]) -> list[bytes | None]:
        """The whole stored bytes of files `peer` holds, in one round trip, for a thread of
        the daemon's own: per file, its bytes checked against its CRC, or None where they did
        not come (a refusal, no answer in time, a bad copy): the caller then reads that file
        the usual way (`stored_blocking`: the other holders, then the image)."""
        assert self._peers is not None
        return self._peers.batch_blocking(peer, entries)

    def peers(self, entry: int) -> list[int]:
        """Peers holding `entry`, live ones only, in the order to ask them (fanfs/node/peers.py)."""
        assert self._peers is not None
        return self._peers.holders(entry)

    async def remote(self, entry: int, offset: int, length: int, crc: int | None) -> bytes | None:
        """Stored bytes of `entry` from the first peer that has a good copy, or None
        (fanfs/node/peers.py: the order, bad copies, hedging)."""
        return None if self._peers is None else await self._peers.get(entry, offset, length, crc)

    def _fell_back(self, began: float) -> None:
        with self._count:
            self.fallbacks += 1
            self.image_latency.record(time.perf_counter() - began)
