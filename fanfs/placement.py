"""Which ranks own which partitions: a pure function of sizes, flags, rank count and replicas.

Every daemon computes the same answer from the catalog alone, with no communication
(mpi4py-fft's `_blockdist` style). Partitions flagged broadcast are owned by every rank. The
others are placed largest first, each on the `replicas` least-loaded distinct ranks (LPT), ties
broken by rank id, so the result is deterministic. Because prepare balances partitions to within
one file, ranks end up balanced to within about one partition.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from fanfs.image.catalog import PART_BROADCAST


def place(
    part_size: Sequence[int] | np.ndarray,
    part_flags: Sequence[int] | np.ndarray,
    n_ranks: int,
    replicas: int = 1,
) -> list[tuple[int, ...]]:
    """owners[p]: the ranks holding partition p, primary first."""
    if n_ranks < 1:
        raise ValueError("n_ranks must be at least 1")
    replicas = max(1, min(replicas, n_ranks))
    sizes = np.asarray(part_size, dtype=np.int64)
    flags = np.asarray(part_flags, dtype=np.int64)
    owners: list[tuple[int, ...]] = [()] * len(sizes)
    everyone = tuple(range(n_ranks))
    load = [(0, r) for r in range(n_ranks)]  # heap of (bytes, rank)
    order = sorted(range(len(sizes)), key=lambda p: (-int(sizes[p]), p))
    for p in order:
        if flags[p] & PART_BROADCAST:
            owners[p] = everyone
            continue
        chosen = [heapq.heappop(load) for _ in range(replicas)]
        owners[p] = tuple(rank for _, rank in chosen)
        for used, rank in chosen:
            heapq.heappush(load, (used + int(sizes[p]), rank))
    return owners


def owned_by(owners: Sequence[tuple[int, ...]], rank: int) -> list[int]:
    return [p for p, ranks in enumerate(owners) if rank in ranks]


def rank_bytes(owners: Sequence[tuple[int, ...]], part_size: Sequence[int] | np.ndarray,
               n_ranks: int) -> list[int]:  # fmt: skip
    total = [0] * n_ranks
    for p, ranks in enumerate(owners):
        for r in ranks:
            total[r] += int(part_size[p])
    return total
