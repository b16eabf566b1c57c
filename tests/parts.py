"""A daemon's parts for adapter tests: built as fanfs/node/assemble.py builds them, without a
mount, MPI or the native pool, so the read path can be driven directly under trio."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fanfs.image import catalog as cat
from fanfs.node.plans import Plans
from fanfs.node.pool import NativePool
from fanfs.node.reader import BadFiles, Reader
from fanfs.node.sources import Local, PeerServer, Sources
from fanfs.node.store import PartitionStore


def local(c: cat.Catalog, store: PartitionStore, rank: int = 0,
          owners: Sequence[tuple[int, ...]] | None = None) -> Local:  # fmt: skip
    mine = np.ones(c.n_partitions, dtype=bool) if owners is None else np.array(
        [rank in o for o in owners], dtype=bool)  # fmt: skip
    return Local(c, store, mine)


def reader(c: cat.Catalog, store: PartitionStore | Local, cache_bytes: int = 1 << 20, *,
           owners: Sequence[tuple[int, ...]] | None = None, transport: Any = None,
           plans: Plans | None = None) -> Reader:  # fmt: skip
    """A Reader over `store` (or a Local of it), with peers through `transport`."""
    rank = transport.rank if transport is not None else 0
    loc = store if isinstance(store, Local) else local(c, store, rank, owners)
    bad = BadFiles(c)
    return Reader(c, Sources(c, loc, owners, transport), cache_bytes, bad,
                  NativePool(c, None, bad.mark), plans)  # fmt: skip


def server(c: cat.Catalog, store: PartitionStore, rank: int = 0,
           owners: Sequence[tuple[int, ...]] | None = None) -> PeerServer:  # fmt: skip
    return PeerServer(c, local(c, store, rank, owners))
