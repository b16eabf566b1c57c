"""Which peers to ask for a file's stored bytes, in which order, and what to do when one fails:
the one owner of that policy (issue 40: one owner per policy), asked by every caller.

`in_turn` is the holder order: a file's holders rotated per file (by entry number, to spread
load over replicas), without this daemon, the peers the transport holds for dead, and those
already asked. Every path that asks peers takes its order from it: `Peers` below (the event
loop's reads, the planner's threads, their batches) and the MPI thread's fetches for the front
(fanfs/node/transport/front.py), which keeps its own state machine (it cannot await) but asks
`in_turn` for the next holder after a refusal, a bad copy, a silent or a slow holder.

`Peers` asks the holders of a file in that order until one gives a good copy: a reply that
does not match the CRC the caller gives is a bad copy (counted, logged), and the next holder is
asked; a refusal or a peer timeout too. With more than one holder, a peer that has not answered
within the hedge delay (`PeerTransport.hedge_delay`, the transport's measure of slow) is not
waited for alone: the next holder is asked too and the first good answer wins (the other fetch
is cancelled; its late reply is drained by the transport). When no holder can answer the
caller gets None and reads the image. Who is dead is the transport's to know (it sees the
timeouts); this module asks it (`is_dead`).

Concurrency: `get` runs in the trio thread; `get_blocking` and `batch_blocking` in threads of
the daemon's own (never the event loop's), through the transport's blocking fetches. Counters
change under a lock.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import trio

from fanfs.image import catalog as cat
from fanfs.image.checksum import crc32
from fanfs.node.transport import PeerTimeout

log = logging.getLogger(__name__)


def in_turn(entry: int, holders: Sequence[int], rank: int, dead: Callable[[int], bool],
            tried: Collection[int] = ()) -> list[int]:  # fmt: skip
    """The holders of `entry` to ask, in the order to ask them: rotated per file (entry mod
    their count) to spread load over replicas, without `rank` (this daemon), the `dead` and
    those `tried` already."""
    k = entry % max(1, len(holders))
    rotated = [*holders[k:], *holders[:k]]
    return [p for p in rotated if p != rank and not dead(p) and p not in tried]


class Asked(Protocol):
    """What `Peers` asks of a transport (fanfs/node/transport's PeerTransport)."""

    rank: int
    blocking_fetch: bool

    def is_dead(self, peer: int) -> bool: ...

    def hedge_delay(self) -> float: ...

    async def fetch(self, peer: int, entry: int, offset: int,
                    length: int) -> bytes | None: ...  # fmt: skip

    def fetch_blocking(self, peer: int, entry: int, offset: int,
                       length: int) -> bytes | None: ...  # fmt: skip

    def fetch_batch_blocking(self, peer: int, entries: list[int],
                             lengths: list[int]) -> list[memoryview] | None: ...  # fmt: skip


class Peers:
    def __init__(self, catalog: cat.Catalog, owners: Sequence[tuple[int, ...]], transport: Asked):
        """`owners[p]`: the ranks holding partition p."""
        self.catalog = catalog
        self.owners = owners
        self.transport = transport
        self._count = threading.Lock()
        self.bad_payloads = 0
        self.hedged = 0  # fetches asked of a second holder because the first was slow
        self.hedges_won = 0  # ... that the second holder answered first

    def holders(self, entry: int) -> list[int]:
        """Live peers holding `entry`, in the order to ask them (`in_turn`)."""
        ranks = self.owners[int(self.catalog.part[entry])]
        return in_turn(entry, ranks, self.transport.rank, self.transport.is_dead)

    async def get(self, entry: int, offset: int, length: int, crc: int | None) -> bytes | None:
        """Stored bytes of `entry` from the first holder that has them, or None. With `crc`,
        a reply that does not match it is a bad copy: the next holder is asked. With more
        than one holder, a slow one is hedged: the next is asked too after the hedge delay."""
        return await self._hedged(self.holders(entry), entry, offset, length, crc)

    async def _ask(self, peer: int, entry: int, offset: int, length: int,
                   crc: int | None) -> bytes | None:  # fmt: skip
        """One peer's good copy, or None (no answer in time, a refusal, a bad copy)."""
        try:
            stored = await self.transport.fetch(peer, entry, offset, length)
        except PeerTimeout:
            return None
        if stored is not None and self.good(entry, peer, stored, crc):
            return stored
        return None

    async def _hedged(self, peers: list[int], entry: int, offset: int, length: int,
                      crc: int | None) -> bytes | None:  # fmt: skip
        """Ask `peers` in turn: the next when the last asked has failed, or (with more than
        one) has not answered within the hedge delay; the first good copy wins."""
        if len(peers) <= 1:  # nothing to hedge with: no hedge delay asked for
            return await self._ask(peers[0], entry, offset, length, crc) if peers else None
        transport = self.transport
        send, answers = trio.open_memory_channel[tuple[int, bytes | None]](len(peers))
        waiting = 0
        left = iter(enumerate(peers))
        more = True  # holders not asked yet

        async def ask(k: int, peer: int) -> None:
            send.send_nowait((k, await self._ask(peer, entry, offset, length, crc)))

        async with trio.open_nursery() as nursery:

            def next_one() -> bool:
                nonlocal waiting, more
                k, peer = next(left, (-1, -1))
                if k < 0:
                    more = False
                    return False
                waiting += 1
                nursery.start_soon(ask, k, peer)
                return True

            next_one()
            while waiting:
                delay = transport.hedge_delay() if more else math.inf
                with trio.move_on_after(delay) as slow:
                    k, got = await answers.receive()
                if slow.cancelled_caught:
                    if next_one():
                        with self._count:
                            self.hedged += 1
                    continue
                waiting -= 1
                if got is not None:
                    if k > 0 and waiting:  # the first asked is still out: the hedge won
                        with self._count:
                            self.hedges_won += 1
                    nursery.cancel_scope.cancel()
                    return got
                next_one()  # that one failed: the next at once
        return None

    def get_blocking(self, entry: int, offset: int, length: int,
                     crc: int | None) -> bytes | None:  # fmt: skip
        """`get` for a thread of the daemon's own, through the transport's blocking fetch
        (`blocking_fetch`): the holders one after the other, no hedging."""
        for peer in self.holders(entry):
            try:
                stored = self.transport.fetch_blocking(peer, entry, offset, length)
            except PeerTimeout:
                continue
            if stored is not None and self.good(entry, peer, stored, crc):
                return stored
        return None

    def batch_blocking(self, peer: int, entries: list[int]) -> list[bytes | None]:
        """The whole stored bytes of files `peer` holds, in one round trip, for a thread of
        the daemon's own: per file, its bytes checked against its CRC, or None where they did
        not come (a refusal, no answer in time, a bad copy)."""
        c = self.catalog
        lengths = [int(c.stored_len[e]) for e in entries]
        try:
            got = self.transport.fetch_batch_blocking(peer, entries, lengths)
        except PeerTimeout:
            got = None
        if got is None:
            return [None] * len(entries)
        return [bytes(stored) if self.good(e, peer, stored, int(c.crc[e])) else None
                for e, stored in zip(entries, got, strict=True)]  # fmt: skip

    def good(self, entry: int, peer: int, stored: bytes | memoryview, crc: int | None) -> bool:
        """Whether a peer's reply matches its CRC; a bad copy is counted and logged."""
        if crc is None or crc32(stored) == crc:
            return True
        with self._count:
            self.bad_payloads += 1
        log.warning("bad payload for %s from rank %d, trying another source",
                    os.fsdecode(b"/" + self.catalog.path(entry)), peer)  # fmt: skip
        return False
