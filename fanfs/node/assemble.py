"""The daemon's object graph, built in one place: each part handed what it uses, in order.

Read top to bottom, `build` is the daemon: the store's bytes (`Local`) first, the peer server
that answers from them, the transport that is handed the server, the one source choice over
both, the bad-file registry, the native pool, the planned epochs' state, the Reader that asks
all of these, the read-ahead engine and its socket, and the FUSE adapter in front. Nothing is
attached to any object after it is built: a lower part never calls up into a higher one (the
transport knows the server, not the Reader; the pool reports bad files to the registry, not to
the Reader). tests/unit/test_layers.py checks that no module of the daemon's wing assigns to
another object's attributes.

`report` gathers every part's statistics into the one status record `fanfs status` shows.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from fanfs import placement
from fanfs.image.catalog import Catalog
from fanfs.node import fuse_ops
from fanfs.node.front import Front
from fanfs.node.order import default_budget
from fanfs.node.planner import ReadAhead
from fanfs.node.plans import Plans
from fanfs.node.plansocket import PlanServer
from fanfs.node.pool import NativePool
from fanfs.node.reader import BadFiles, Reader
from fanfs.node.sources import WHOLE_FILE_LIMIT, Local, PeerServer, Sources
from fanfs.node.store import PartitionStore
from fanfs.node.transport import PeerTransport
from fanfs.status import CatalogStatus, Status
from fanfs.switches import Switches

log = logging.getLogger(__name__)


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
    switches: Switches = cfg.switches
    front_on = fuse_ops.RECEIVER is not None and switches.front
    transport: PeerTransport | None = None
    if world is not None:
        from fanfs.node.transport.front import FrontFetches
        from fanfs.node.transport.mpi import MpiTransport

        native = front_on and switches.native_remote
        front_fetches = FrontFetches() if native else None  # handed to the MPI thread
        transport = MpiTransport(world, cfg.peer_timeout, server, front_fetches,
                                 plane=switches.plane)  # fmt: skip
    sources = Sources(catalog, local, owners, transport)
    bad = BadFiles(catalog)
    front = None
    if front_on:
        assert fuse_ops.RECEIVER is not None
        front = Front(*fuse_ops.RECEIVER, *fuse_ops.FRONT_ATTRS, mine, switches.spin_us,
                      holders(owners), rank, switches.pretend_protocol)  # fmt: skip
    pool = NativePool(
        catalog,
        fuse_ops.INSTALL_HOOK,
        bad.mark,
        decode=switches.native_decode,
        push=switches.push,
        front=front,
        front_off=front_off(switches),
    )
    budget = cfg.prefetch_bytes if cfg.prefetch_bytes is not None else default_budget()
    plans = Plans(catalog, budget, pool.planned, pool.held)
    reader = Reader(catalog, sources, cfg.cache_bytes, bad, pool, plans)
    read_ahead = ReadAhead(catalog, plans, sources, fuse_ops.push_to_kernel, reader.cached,
                           pool)  # fmt: skip
    plan_server = PlanServer(
        catalog, plans, WHOLE_FILE_LIMIT, dropper(catalog, store, pool, reader)
    )
    ops = fuse_ops.FanfsOperations(catalog, reader, status)
    return Node(catalog, store, local, server, transport, sources, bad, pool, plans, reader,
                read_ahead, plan_server, ops)  # fmt: skip


def dropper(catalog: Catalog, store: PartitionStore, pool: NativePool,
            reader: Reader) -> Callable[[], Awaitable[dict[str, object]]]:  # fmt: skip
    """`fanfs drop`: what is cached of the mount's files, dropped everywhere the daemon can
    (a user's cold pass, without root's drop_caches): the kernel's pages of every file of the
    mount (invalidated one inode at a time, in a worker thread, since the kernel may wait for
    READs in flight), the staged copies' pages (posix_fadvise), the pool's decoded pieces and
    the Reader's cache."""

    async def drop() -> dict[str, object]:
        files = np.flatnonzero(catalog.is_file)

        def forget() -> int:
            return sum(fuse_ops.forget_pages(int(e)) for e in files)

        known = await trio.to_thread.run_sync(forget)
        pool.drop()
        reader.drop()
        staged = await trio.to_thread.run_sync(store.drop_pages)
        return {"dropped": True, "inodes": known, "partitions": staged}

    return drop


def front_off(switches: Switches) -> str:
    """Why this daemon has no front, in one line ("": it has one)."""
    if fuse_ops.RECEIVER is None:
        return "pyfuse3 is not fanfs's patched build (run `make setup`)"
    return "" if switches.front else "FANFS_FRONT=0"


def holders(owners: list[tuple[int, ...]]) -> np.ndarray:
    """The ranks holding each partition as the C takes them: partitions x lib.MAX_OWNERS,
    -1 padded (a partition on more ranks than that: the first ones)."""
    from fanfs.native import lib

    out = np.full((len(owners), lib.MAX_OWNERS), -1, dtype="<i4")
    for p, ranks in enumerate(owners):
        out[p, : min(len(ranks), lib.MAX_OWNERS)] = ranks[: lib.MAX_OWNERS]
    return out


def owners_of(catalog: Catalog, size: int, replicas: int) -> list[tuple[int, ...]]:
    return placement.place(catalog.part_size, catalog.part_flags, size, replicas)


def report(node: Node, *, image: str, mountpoint: str, rank: int, size: int, replicas: int,
           node_name: str, serving: bool, started: float, plan_socket: str) -> Status:  # fmt: skip
    """The status record of a daemon: its own facts, then every part's statistics."""
    pool = node.pool.stats()
    r = node.read_ahead
    pool_lost = node.pool.followed_lost()
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
        native_frame_hits=pool["hits"],
        native_frame_misses=pool["misses"],
        native_pushes=pool["pushes"],
        native_pushed_bytes=pool["pushed_bytes"],
        native_direct_reads=pool["direct"],
        native_cached_reads=pool["cached"],
        native_fast_reads=pool["fast"],
        front=node.pool.front_status(),
        uptime_s=round(time.time() - started, 3),
        catalog=CatalogStatus(
            entries=c.n_entries, files=int(c.is_file.sum()), memory_bytes=c.memory_bytes()
        ),
        store=node.store.statistics(),
        reader=node.reader.statistics(),
        peers=node.transport.statistics() if node.transport is not None else None,
        plan=node.plans.statistics(
            r.prefetched,
            r.pushed,
            r.prefetched_bytes,
            r.failed,
            r.followed,
            pool_lost,
            r.in_c,
            r.from_peers,
            r.together,
        ),
        plan_socket=plan_socket,
        budget={
            **node.pool.budget(),
            **(node.transport.budget() if node.transport is not None else {}),
        },
    )
