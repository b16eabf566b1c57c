"""The in-process transport: N simulated ranks in one trio run, with the MPI transport's protocol.

Real code, not a test double (as dask's `inproc`): everything above the transport (remote reads,
replicas, routing around a dead peer, lingering) runs here with no mpirun, in one process, so
it can be tested alone and fast. `Cluster(servers, peer_timeout)` holds one `InprocTransport`
per simulated daemon, each handed its daemon's peer server. A fetch awaits the peer's server
directly and copies its reply (a peer's buffer is never shared, as over MPI), all bounded by
the peer timeout. `Cluster.silence(rank)`
makes a rank stop answering, as a killed or stopped daemon does: fetches to it wait for the peer
timeout, raise PeerTimeout, and the rank is routed around from then on; `Cluster.slow(rank, s)`
makes it answer `s` seconds late, as an overloaded node does.

Concurrency: everything runs in the one trio thread; a reply is produced by the peer's own
reader in a task of its own, so a slow peer delays only the fetches waiting for it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import trio

from fanfs.node.transport import PeerTimeout, PeerTransport, Served


class Cluster:
    """The simulated ranks of one job."""

    def __init__(self, servers: Sequence[Served], peer_timeout: float):
        n = len(servers)
        self.ranks = [InprocTransport(self, r, n, peer_timeout, s) for r, s in enumerate(servers)]
        self.silent: set[int] = set()
        self.delay: dict[int, float] = {}

    def silence(self, rank: int) -> None:
        """From now on `rank` answers nobody (its own fetches still work)."""
        self.silent.add(rank)

    def slow(self, rank: int, seconds: float) -> None:
        """From now on `rank` answers `seconds` late."""
        self.delay[rank] = seconds


class InprocTransport(PeerTransport):
    def __init__(self, cluster: Cluster, rank: int, size: int, peer_timeout: float,
                 server: Served):  # fmt: skip
        super().__init__(rank, size, peer_timeout, server)
        self.cluster = cluster

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peers until cancelled (a nursery for pings while lingering)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        if peer in self._dead:
            raise PeerTimeout(f"rank {peer} is dead")
        began = time.perf_counter()
        data: Any = None
        with trio.move_on_after(self.peer_timeout) as scope:
            if peer in self.cluster.silent:
                await trio.sleep_forever()
            await trio.sleep(self.cluster.delay.get(peer, 0.0))
            owner = self.cluster.ranks[peer]
            data = await owner._serve_request(self.rank, entry, offset, length)
            owner._count_reply(entry, data)
        if scope.cancelled_caught:
            raise self.timed_out(peer)
        if data is None or len(data) != length:
            return None
        self._fetched(began, length, time.perf_counter())
        return bytes(data)

    def _say_bye(self) -> None:
        for peer in self.cluster.ranks:
            if peer.rank != self.rank and self.rank not in self.cluster.silent:
                peer._byes.add(self.rank)
