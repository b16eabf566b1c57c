"""How daemons ask each other for stored file bytes.

`mpi.py` is the transport that crosses nodes (its messages: inbox.py; its server side:
answer.py; the front's fetches it takes on: front.py; the records its threads hand each other:
commands.py); `inproc.py` runs N simulated ranks in one trio run with the same protocol, for
tests of everything above the transport without mpirun. With a single daemon nothing is remote
and no transport exists. Which peer to ask, and in which order, is fanfs/node/peers.py's.

`PeerTransport` holds what both share: who is dead and who said bye, the counters behind
`fanfs status`, serving one request (through the `Served` it is handed: fanfs/node/sources.py,
which checks it against the catalog and answers from the store), pings and the linger that
keeps a daemon serving until its peers are done. Its methods run in the trio thread;
subclasses provide `fetch`, `_say_bye` and a nursery.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from fanfs.node.cache import Latencies
from fanfs.status import PeerStatus, Percentiles

log = logging.getLogger(__name__)

# A peer fetch not answered within max(HEDGE_MIN_S, HEDGE_P99 x the recent p99 of peer fetches)
# is asked of another holder too (replicas). The delay is recomputed every HEDGE_EVERY fetches
# (a percentile of the kept samples costs far more than a fetch's bookkeeping).
HEDGE_MIN_S = 2e-3
HEDGE_P99 = 2.0
HEDGE_EVERY = 256


class Served(Protocol):
    """What a peer may ask of this daemon (fanfs/node/sources.py's PeerServer)."""

    async def serve(self, entry: int, offset: int, length: int) -> bytes | None:
        """The stored bytes asked for, or None if this daemon cannot serve them."""

    def locate(self, entry: int, offset: int, length: int) -> tuple[int, int] | None:
        """(partition, start) of a request a plain read answers (from any thread), or None."""

    def cached(self, part: int, start: int, length: int) -> bytearray | None:
        """The bytes if the page cache holds them all (never waits for the disk), else None."""

    def pread(self, part: int, start: int, length: int) -> bytes:
        """Exactly the bytes (may wait for the disk; OSError on failure)."""

    def whole(self, entry: int) -> tuple[int, int, int] | None:
        """(partition, start, stored length) of a file's whole stored bytes when a plain read
        answers them (any thread), or None."""


class PeerTimeout(Exception):
    """A peer did not answer within the peer timeout; it is routed around from now on."""


class PeerTransport:
    blocking_fetch = False  # whether `fetch_blocking` works (threads of its own serve it)
    batches = False  # whether `fetch_batch_blocking` works
    plane_fetches = False  # whether the data plane (C) fetches peers' small files (mpi.py)

    def __init__(self, rank: int, size: int, peer_timeout: float, server: Served):
        self.rank = rank
        self.size = size
        self.peer_timeout = peer_timeout
        self.server = server
        self._dead: set[int] = set()
        self._byes: set[int] = set()
        self._nursery: trio.Nursery | None = None
        self._latency = Latencies()  # of fetches from peers
        self.fetch_bytes = 0
        self.timeouts = 0
        self.served = 0
        self.served_direct = 0  # without the event loop (the transport's own threads)
        self.served_bytes = 0
        self.refused = 0
        self.malformed = 0  # peer messages dropped as malformed
        self._hedge_s = HEDGE_MIN_S
        self._hedge_at = 0  # fetches counted when the hedge delay was last computed
        self.batch_fetches = 0  # batches of whole files fetched in one round trip (planners')
        self.batched_files = 0  # ... and the files in them

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        """`length` stored bytes of `entry` from `offset`, from `peer`; None if it has none.
        Raises PeerTimeout if the peer does not answer within the peer timeout."""
        raise NotImplementedError

    def fetch_blocking(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        """`fetch` from a thread of the daemon's own, where the transport has threads of its
        own to serve it (the MPI one); NotImplementedError elsewhere."""
        raise NotImplementedError

    def fetch_batch_blocking(self, peer: int, entries: list[int],
                             lengths: list[int]) -> list[memoryview] | None:  # fmt: skip
        """The whole stored bytes of several files `peer` holds, in one round trip, from a
        thread of the daemon's own (`batches`); NotImplementedError elsewhere."""
        raise NotImplementedError

    def _say_bye(self) -> None:
        """Tell every live peer that this daemon has unmounted."""
        raise NotImplementedError

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peers until cancelled; `started` once requests are answered."""
        raise NotImplementedError

    def stop(self) -> None:
        """Release what `run` started once serving is over (nothing by default)."""

    @property
    def hedged(self) -> int:
        """The front's fetches asked of another holder too (mpi.py's front.py): none here."""
        return 0

    @property
    def hedges_won(self) -> int:
        """... that the other holder answered first."""
        return 0

    def is_dead(self, peer: int) -> bool:
        return peer in self._dead

    @property
    def dead(self) -> set[int]:
        return set(self._dead)

    def mark_dead(self, peer: int, why: str) -> None:
        if peer not in self._dead:
            self._dead.add(peer)
            log.warning("peer rank %d %s: routing around it from now on", peer, why)

    def timed_out(self, peer: int) -> PeerTimeout:
        self.timeouts += 1
        self.mark_dead(peer, f"did not answer within {self.peer_timeout} s")
        return PeerTimeout(f"rank {peer} did not answer")

    def _fetched(self, began: float, length: int, now: float) -> None:
        self._record(now - began, length)

    def _record(self, seconds: float, length: int) -> None:
        """A fetch from a peer took `seconds` and got `length` bytes."""
        self._latency.record(seconds)
        self.fetch_bytes += length

    async def ping(self, peer: int) -> bool:
        """True if `peer` answers (an empty request) within the peer timeout."""
        try:
            await self.fetch(peer, -1, 0, 0)
            return True
        except PeerTimeout:
            return False

    async def _serve_request(
        self, peer: int, entry: int, offset: int, length: int
    ) -> bytes | memoryview | None:
        """The reply to a peer's request: exactly `length` bytes, or None (a refusal). A ping
        (entry -1, length 0) gets None too, which is its answer. Not counted: the sender of
        the reply counts it (`_count_reply`), in whichever thread sends."""
        data: bytes | memoryview | None = None
        if entry >= 0 and length > 0:
            try:
                data = await self.server.serve(entry, offset, length)
            except Exception:
                log.exception("serving entry %d to rank %d failed", entry, peer)
            if data is not None and len(data) != length:
                data = None
        return data

    def _count_reply(self, entry: int, data: bytes | bytearray | memoryview | None,
                     direct: bool = False, files: int = 1) -> None:  # fmt: skip
        if data is not None:
            self.served += files
            self.served_direct += direct * files
            self.served_bytes += len(data)
        elif entry >= 0:  # not a ping
            self.refused += 1

    async def linger(self, grace: float) -> None:
        """Say bye, then keep serving until every live peer has said bye (or `grace` passed)."""
        self._say_bye()
        start = trio.current_time()
        deadline = start + grace
        checked: dict[int, float] = {}  # last ping per peer; none before one peer timeout
        while trio.current_time() < deadline:
            waiting = [p for p in range(self.size) if p != self.rank and p not in self._byes]
            waiting = [p for p in waiting if p not in self._dead]
            if not waiting:
                return
            # A killed peer never says bye: ping the quiet ones, once per peer timeout.
            for p in waiting:
                if trio.current_time() - checked.get(p, start) > self.peer_timeout:
                    checked[p] = trio.current_time()
                    assert self._nursery is not None
                    self._nursery.start_soon(self.ping, p)
            await trio.sleep(0.05)
        log.warning("stopped waiting for peers after %.0f s", grace)

    @property
    def fetches(self) -> int:
        """Fetches from peers answered so far."""
        return self._latency.count

    def latency_ms(self) -> Percentiles:
        """Percentiles of the recent fetches from peers, in milliseconds."""
        return self._latency.percentiles_ms()

    def hedge_delay(self) -> float:
        """How long a fetch waits for one holder before another is asked too (any thread:
        a stale value is only a slightly different delay)."""
        count = self.fetches
        if count - self._hedge_at >= HEDGE_EVERY:
            self._hedge_at = count
            self._hedge_s = max(HEDGE_MIN_S, HEDGE_P99 * self.latency_ms().p99 / 1e3)
        return min(self._hedge_s, self.peer_timeout)

    def budget(self) -> dict[str, int]:
        """The owner's side of the latency budget (`Answers.budget`): none unless it answers
        peers over MPI."""
        return {}

    def statistics(self) -> PeerStatus:
        return PeerStatus(
            remote_fetches=self._latency.count,
            remote_bytes=self.fetch_bytes,
            remote_ms=self._latency.percentiles_ms(),
            peer_timeouts=self.timeouts,
            served_to_peers=self.served,
            served_without_event_loop=self.served_direct,
            bytes_served_to_peers=self.served_bytes,
            refused_to_peers=self.refused,
            malformed_messages=self.malformed,
            batch_fetches=self.batch_fetches,
            batched_files=self.batched_files,
            dead_peers=sorted(self._dead),
            peers_said_bye=sorted(self._byes),
        )
