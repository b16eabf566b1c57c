"""PyTorch samplers that know fanfs: `PlannedSampler` tells the daemon each epoch's order
(planned epochs); `LocalitySampler` chooses how much of an epoch is read from other nodes.

    sampler = DistributedSampler(dataset, shuffle=True)        # or any sampler
    sampler = fanfs.torch.PlannedSampler(sampler, paths, "/mnt/data")
    loader = DataLoader(dataset, sampler=sampler, num_workers=4, ...)

`paths[i]` is the file sample i is read from (under the mount, relative or absolute). Each
`__iter__` draws the wrapped sampler's indices for the epoch, publishes the files in that order
to the daemon (`fanfs.plan`), then yields exactly those indices, so training sees the samples
it sees without fanfs; `set_epoch` and `len` pass through. As it yields it tells the daemon how
far the epoch has gone (every plan.PROGRESS_EVERY samples), which lets the daemon read further
ahead when the job's reads are answered from the page cache and never reach it. Each training
rank on a node publishes its own share (by default the wrapped sampler's `rank`, else 0). If the
daemon cannot be reached, training goes on unplanned (a warning, once).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from fanfs import plan
from fanfs.errors import FanfsError

log = logging.getLogger(__name__)


class PlannedSampler:
    def __init__(
        self,
        sampler: Any,
        paths: Sequence[str | os.PathLike[str]],
        mountpoint: str | os.PathLike[str],
        share: int | None = None,
    ):
        self.sampler = sampler
        self.paths = paths
        self.mountpoint = mountpoint
        self.share = int(getattr(sampler, "rank", 0)) if share is None else share
        self._channel: plan.Channel | None = None
        self._warned = False
        self._warned_missing = False

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = [int(i) for i in self.sampler]
        planned = self._call(lambda ch: self._publish(ch, indices))
        for k, i in enumerate(indices):
            if planned and k and k % plan.PROGRESS_EVERY == 0:
                planned = self._call(lambda ch, k=k: ch.progress(k, self.share))
            yield i

    def _publish(self, channel: plan.Channel, indices: list[int]) -> None:
        taken = channel.publish([self.paths[i] for i in indices], self.share)
        if taken.missing and not self._warned_missing:
            self._warned_missing = True
            log.warning("fanfs: %d of %d planned paths name no file under %s (e.g. %r): they "
                        "are read unplanned", taken.missing, len(indices), channel.root,
                        taken.first_missing)  # fmt: skip

    def _call(self, fn: Any) -> bool:
        try:
            if self._channel is None:
                self._channel = plan.Channel(self.mountpoint)
            fn(self._channel)
            return True
        except FanfsError as e:
            if not self._warned:
                self._warned = True
                log.warning("fanfs: reading without a plan: %s", e)
            self._channel = None
            return False


class LocalitySampler:
    """A drop-in for PyTorch's `DistributedSampler` that knows where fanfs keeps each file.

    `paths[i]` is sample i's file (under the mount, relative or absolute). `q` chooses how much
    of an epoch crosses the network: 0 is *local shuffling* (each training rank reads only files
    its node holds, shuffled anew every epoch), 1 is a *global shuffle* (about (N-1)/N of the
    reads remote on N nodes, like `DistributedSampler`), and in between is *partial local
    shuffling* (each epoch a random fraction q of the samples is pooled and dealt out across
    the job; the rest stay on their node), after "Why Globally Re-shuffle? Revisiting Data
    Shuffling in Large Scale Deep Learning" (IPDPS 2022).

    Like `DistributedSampler`: `set_epoch`, the same length on every rank, `ceil(len/N)`
    (`floor(len/N)` with `drop_last`), so an epoch takes exactly as many steps as
    DistributedSampler's; every sample at least once per epoch across the job (short ranks
    padded by repeating their own first samples); deterministic for `seed` and the epoch; and
    no communication: every rank computes the whole job's assignment from the image's catalog
    (`fanfs.plan.placement`). Training ranks map to nodes by `node_of_rank` (default: through
    `torch.distributed` when it is initialized, else ranks in blocks over the nodes, as Slurm
    places them). fanfs balances nodes by bytes, so one node may hold a few more *files* than
    its ranks read in an epoch: that surplus goes into the pool dealt out across the job (a
    few remote reads even at q = 0), rather than making every rank's epoch longer.
    Every path must name a file under the mount (ValueError otherwise).
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        mountpoint: str | os.PathLike[str],
        q: float = 0.0,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        node_of_rank: Sequence[int] | None = None,
    ):
        where = plan.placement(mountpoint, paths)
        lost = [i for i, h in enumerate(where.holders) if not h]
        if lost:
            raise ValueError(f"{len(lost)} of {len(paths)} paths name no file under "
                             f"{mountpoint} (e.g. {os.fspath(paths[lost[0]])!r})")  # fmt: skip
        self._configure(where, q, num_replicas, rank, seed, drop_last, node_of_rank)

    @classmethod
    def from_placement(cls, where: plan.Placement, q: float = 0.0, num_replicas: int | None = None,
                       rank: int | None = None, seed: int = 0, drop_last: bool = False,
                       node_of_rank: Sequence[int] | None = None) -> LocalitySampler:  # fmt: skip
        """A sampler over `where.holders` (one per sample) without asking a mount."""
        self = cls.__new__(cls)
        self._configure(where, q, num_replicas, rank, seed, drop_last, node_of_rank)
        return self

    def _configure(
        self,
        where: plan.Placement,
        q: float,
        num_replicas: int | None,
        rank: int | None,
        seed: int,
        drop_last: bool,
        node_of_rank: Sequence[int] | None,
    ) -> None:
        import numpy as np

        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be between 0 and 1, not {q}")
        dist = _distributed()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist is not None else where.nodes
        if rank is None:
            rank = dist.get_rank() if dist is not None else where.node
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        if node_of_rank is None:
            if dist is not None:
                gathered: list[Any] = [None] * num_replicas
                dist.all_gather_object(gathered, where.node)
                node_of_rank = [int(n) for n in gathered]
            else:
                node_of_rank = [r * where.nodes // num_replicas for r in range(num_replicas)]
        if len(node_of_rank) != num_replicas:
            raise ValueError("node_of_rank needs one node per rank")
        self.q, self.seed, self.drop_last = q, seed, drop_last
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0
        self.nodes = where.nodes
        self.node_of_rank = [int(n) for n in node_of_rank]
        self.holders = where.holders
        # One home node per sample: its holder, spread over replicas by sample index.
        self._home = np.array([h[i % len(h)] if h else -1 for i, h in enumerate(self.holders)],
                              dtype=np.int64)  # fmt: skip
        n = len(self.holders)
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.assignment(self.epoch)[self.rank])

    def assignment(self, epoch: int) -> list[list[int]]:
        """Every rank's samples for `epoch`, in order (the same on every rank)."""
        import numpy as np

        rng = np.random.default_rng([self.seed, epoch])
        n, home = len(self._home), self._home
        ranks_on: dict[int, list[int]] = {}
        for r, node in enumerate(self.node_of_rank):
            ranks_on.setdefault(node, []).append(r)
        pooled = (rng.random(n) < self.q) | (home < 0) | ~np.isin(home, list(ranks_on))
        kept: dict[int, Any] = {}
        spill = [np.flatnonzero(pooled)]
        for node, ranks in sorted(ranks_on.items()):
            mine = rng.permutation(np.flatnonzero((home == node) & ~pooled))
            room = self.num_samples * len(ranks)
            kept[node], rest = mine[:room], mine[room:]
            spill.append(rest)
        pool = rng.permutation(np.concatenate(spill))
        slots = np.concatenate([np.full(self.num_samples * len(ranks) - len(kept[node]), node)
                                for node, ranks in sorted(ranks_on.items())])  # fmt: skip
        slots = rng.permutation(slots)[: len(pool)]
        out: list[list[int]] = [[] for _ in range(self.num_replicas)]
        order = rng.permutation(n)  # pads a rank that got nothing at all
        for node, ranks in sorted(ranks_on.items()):
            items = rng.permutation(np.concatenate([kept[node], pool[: len(slots)][slots == node]]))
            for k, r in enumerate(ranks):
                mine = items[k :: len(ranks)].tolist()
                pad = mine or order.tolist()
                while len(mine) < self.num_samples:
                    mine += pad[: self.num_samples - len(mine)]
                out[r] = mine[: self.num_samples]
        return out

    def remote_share(self, epoch: int) -> float:
        """The share of this epoch's distinct (node, file) reads whose file another node holds."""
        reads = {(self.node_of_rank[r], i) for r, got in enumerate(self.assignment(epoch))
                 for i in got}  # fmt: skip
        remote = sum(1 for node, i in reads if node not in self.holders[i])
        return remote / max(1, len(reads))


def _distributed() -> Any:
    """torch.distributed when it is initialized, else None (no torch needed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None
