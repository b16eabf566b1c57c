"""The daemon's object graph, built in one place: each part handed what it uses, in order.

Read top to bottom, `build` is the daemon: the store's bytes (`Local`) first, the peer server
that answers from them, the transport that is handed the server, the one source choice over
both, the bad-file registry, the native pool, the planned epochs' state, the Reader that asks
all of these, the read-ahead engine and its socket, and the FUSE adapter in front. Nothing is
attached to any object after it is built: a lower part never calls up into a higher one (the
transport knows the server, not the Reader; the pool reports bad files to the registry, not to
the Reader). tests/test_layers.py checks that no module of the daemon's wing assigns to
another object's attributes.

`report` gathers every part's statistics into the one status record `fanfs status` shows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fanfs import placement
from fanfs.catalog import Catalog
from fanfs.node import fuse_ops
from fanfs.node.native import NativePool
from fanfs.node.order import default_budget
from fanfs.node.planner import ReadAhead
from fanfs.node.plans import Plans
from fanfs.node.plansocket import PlanServer
from fanfs.node.reader import BadFiles, Reader
from fanfs.node.sources import WHOLE_FILE_LIMIT, Local, PeerServer, Sources
from fanfs.node.store import PartitionStore
from fanfs.node.transport import PeerTransport
from fanfs.status import CatalogStatus, Status


@dataclass(frozen=True)
class Node:
    """Every part of one daemon, built by `build`."""

    catalog: Catalog
    store: PartitionStore
    local: Local
    server: PeerServer
    transport: PeerTransport | None
    sources: Sources
    bad: BadFiles
    pool: NativePool
    plans: Plans
    reader: Reader
    read_ahead: ReadAhead
    plan_server: PlanServer
    ops: fuse_ops.FanfsOperations


def build(catalog: Catalog, store: PartitionStore, owners: list[tuple[int, ...]], rank: int,
          world: Any, cfg: Any, status: Callable[[], dict[str, Any]]) -> Node:  # fmt: skip
    """The daemon of rank `rank` (`world`: the MPI world, None for one daemon alone), serving
    `catalog` from `store`; `cfg` is its MountConfig; `status()` is what the mount's status
    attribute answers."""
    mine = np.array([rank in o for o in owners], dtype=bool)
    local = Local(catalog, store, mine)
    server = PeerServer(catalog, local)
    transport: PeerTransport | None = None
    if world is not None:
        from fanfs.node.transport.mpi import MpiTransport

        transport = MpiTransport(world, cfg.peer_timeout, server)
    sources = Sources(catalog, local, owners, transport)
    bad = BadFiles(catalog)
    pool = NativePool(catalog, fuse_ops.POOL_HOOKS, bad.mark, decode=native_decoding())
    budget = cfg.prefetch_bytes if cfg.prefetch_bytes is not None else default_budget()
    plans = Plans(catalog, budget)
    reader = Reader(catalog, sources, cfg.cache_bytes, bad, pool, plans)
    read_ahead = ReadAhead(catalog, plans, sources, fuse_ops.push_to_kernel, reader.cached)
    plan_server = PlanServer(catalog, plans, WHOLE_FILE_LIMIT)
    ops = fuse_ops.FanfsOperations(catalog, reader, status)
    return Node(catalog, store, local, server, transport, sources, bad, pool, plans, reader,
                read_ahead, plan_server, ops)  # fmt: skip


def native_decoding() -> bool:
    """FANFS_NATIVE_DECODE=0 leaves compressed files to Python (for comparison, or should the
    C decoder ever be suspected); anything else lets the native pool decode them."""
    return os.environ.get("FANFS_NATIVE_DECODE", "1").strip() != "0"


def owners_of(catalog: Catalog, size: int, replicas: int) -> list[tuple[int, ...]]:
    return placement.place(catalog.part_size, catalog.part_flags, size, replicas)


def report(node: Node, *, image: str, mountpoint: str, rank: int, size: int, replicas: int,
           node_name: str, serving: bool, started: float, plan_socket: str) -> Status:  # fmt: skip
    """The status record of a daemon: its own facts, then every part's statistics."""
    spins, frames = fuse_ops.spin_counts(), node.pool.frame_stats()
    r = node.read_ahead
    c = node.catalog
    return Status(
        pid=os.getpid(),
        image=image,
        mountpoint=mountpoint,
        rank=rank,
        size=size,
        replicas=max(1, min(replicas, size)),
        host=os.uname().nodename,
        node=node_name,
        serving=serving,
        no_open=fuse_ops.PATCHED,
        native_read_pool=node.pool.running,
        native_crc32=node.pool.crc32,
        native_decodes=node.pool.decodes,
        native_frame_hits=frames[0],
        native_frame_misses=frames[1],
        spin_caught=spins[0],
        spin_empty=spins[1],
        spin_yielded=spins[2],
        uptime_s=round(time.time() - started, 3),
        catalog=CatalogStatus(
            entries=c.n_entries, files=int(c.is_file.sum()), memory_bytes=c.memory_bytes()
        ),
        store=node.store.statistics(),
        reader=node.reader.statistics(),
        peers=node.transport.statistics() if node.transport is not None else None,
        plan=node.plans.statistics(r.prefetched, r.pushed, r.prefetched_bytes, r.failed),
        plan_socket=plan_socket,
    )
