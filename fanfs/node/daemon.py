"""The mount daemon's lifecycle: validate, mount, serve, and always clean up (its skeleton,
shared with the output daemon, is fanfs/lifecycle.py).

Order (S3QL's mount.py): everything that can fail because of a user mistake (image, partitions,
mount point) is checked before anything is mounted. Under an MPI launcher these checks are the
start-up collectives: rank 0 alone reads the catalog and checks the partitions on shared
storage, then broadcasts the verdict and the catalog bytes; every rank checks its mount point
and all ranks learn whether any failed, so they all fail together with one clear line instead
of some hanging. After start-up no collective operation runs (a dead rank must not block one).

Each resource registers its cleanup on an exit stack the moment it exists, so whatever ends
the daemon (`fanfs umount`/SIGTERM, SIGINT, an external unmount, an error) the mount goes away
first, then the daemon keeps serving peers until they have unmounted too (`--linger`), then the
staged copies are deleted.

Signals (SIGTERM, SIGINT, SIGHUP) mean "stop", whenever they come, and are handled for the
daemon's whole life, never by Python's defaults (which would kill it without cleaning up):
during start-up one is noted and the next start-up collective fails every rank together
(exit 130); while serving, read-ahead stops, then the FUSE session ends (exit 0); while it
lingers after the unmount, it stops waiting for peers; while cleaning up, it is noted and
the cleanup goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import trio

from fanfs import mounts, native, placement
from fanfs.errors import FanfsError
from fanfs.image.catalog import Catalog
from fanfs.lifecycle import Lifecycle, check_mountpoint, expand, node_name, verdict
from fanfs.node import assemble, fuse_ops
from fanfs.node.front import FRONT_THREADS
from fanfs.node.staging import default_parent
from fanfs.node.store import PartitionStore, check_partitions
from fanfs.status import Status
from fanfs.stopsignals import Early
from fanfs.switches import Switches

log = logging.getLogger(__name__)

# Readahead of the mount's bdi: with 1 MiB the kernel asks for big files in 1 MiB requests
# instead of 128 KiB ones (+17 to 28 % on 2 to 8 MiB files here, docs/environment.md).
READ_AHEAD_KB = 1024
# READs the kernel may keep outstanding in the background: its readahead READs are all
# background requests, and at 3/4 of this limit it skips async readahead, so the kernel's own
# 12 would throttle many readers before the front's threads are busy. Four per front thread (a
# reader's READ and its readahead, as many readers as cores); a user's mount gets at most the
# fuse module's max_user_bgreq (thousands: sized from the node's memory).
BACKGROUND = 4 * FRONT_THREADS


@dataclass(frozen=True, slots=True)
class MountConfig:
    image: Path
    mountpoint: str  # may contain {rank} and {node}
    local: str | None = None  # likewise; the parent of the private staging directory
    keep_local: bool = False
    keep: str | None = None  # --keep DIR (may contain {rank} and {node}): copies outlive the job
    keep_size: int | None = None  # its budget in bytes
    nonempty: bool = False  # mount over a directory that holds something (hiding it)
    cache_bytes: int = 512 << 20
    prefetch_bytes: int | None = None  # planned epochs' read-ahead budget; None: from memory
    replicas: int = 1
    peer_timeout: float = 5.0
    linger: float = 60.0
    # FANFS_* (fanfs/switches.py), parsed by the CLI; a config made elsewhere has them all on
    switches: Switches = field(default_factory=Switches)


def _tune_readahead(mountpoint: Path) -> None:
    entry = mounts.find(mountpoint)
    if entry is None:
        return
    try:
        Path(f"/sys/class/bdi/{entry.device}/read_ahead_kb").write_text(f"{READ_AHEAD_KB}\n")
        log.debug("read_ahead_kb of %s set to %d", entry.device, READ_AHEAD_KB)
    except OSError as e:  # not root, or no sysfs: a little slower, still correct
        log.debug("could not raise read_ahead_kb: %s", e)


class Daemon:
    def __init__(self, cfg: MountConfig, early: Early | None = None):
        """`early`: what held the stop signals since the command's start (stopsignals)."""
        self.cfg = cfg
        self.started = time.time()
        self.serving = False
        self.life = Lifecycle(log, noted="%s: stopping",
                              interrupted="stopped by {signal} before serving", early=early,
                              start_timeout_s=cfg.switches.start_timeout_s)  # fmt: skip
        self.node: assemble.Node | None = None  # every part of the daemon, once built
        self.plan_socket = ""
        self.mountpoint = Path(cfg.mountpoint)
        self.phase = "starting"  # starting, serving, lingering, closing
        self._linger_scope = trio.CancelScope()

    @property
    def rank(self) -> int:
        return self.life.rank

    @property
    def size(self) -> int:
        return self.life.size

    def status(self) -> Status:
        assert self.node is not None
        return assemble.report(
            self.node, image=str(self.cfg.image), mountpoint=str(self.mountpoint),
            rank=self.rank, size=self.size, replicas=self.cfg.replicas,
            node_name=node_name(self.rank), serving=self.serving, started=self.started,
            plan_socket=self.plan_socket,
        )  # fmt: skip

    # -- start-up --------------------------------------------------------------------------

    def _load_catalog(self) -> Catalog:
        """Rank 0 reads and checks the image; everyone gets the catalog or rank 0's error."""
        world = self.life.world
        if world is None:
            single, _ = Catalog.load(self.cfg.image)
            check_partitions(self.cfg.image, single, range(single.n_partitions))
            return single
        mine, raw = None, None
        catalog: Catalog | None = None
        if self.rank == 0:
            try:
                catalog, raw = Catalog.load(self.cfg.image)
                check_partitions(self.cfg.image, catalog, range(catalog.n_partitions))
            except FanfsError as e:
                mine = (int(e.exit_code), str(e))
        if (err := verdict(world.bcast(mine), 0)) is not None:
            raise err
        raw = world.bcast_bytes(raw)
        if catalog is None:
            catalog = Catalog.from_bytes(raw, f"{self.cfg.image} (broadcast)")
        log.info("catalog: %d entries, %d bytes broadcast", catalog.n_entries, len(raw))
        return catalog

    def run(self) -> None:
        try:
            self.life.run(self._run, self._gone)
        finally:
            self.phase = "closing"
        log.debug("daemon for %s done", self.cfg.mountpoint)

    def _gone(self) -> Collection[int]:
        """The peers known dead (MPI is not finalized with them)."""
        transport = self.node.transport if self.node is not None else None
        return transport.dead if transport is not None else ()

    def _closing(self) -> None:
        self.phase = "closing"

    def _run(self, stack: contextlib.ExitStack) -> None:
        cfg = self.cfg
        stack.callback(self._closing)  # after every part below is gone, before MPI ends
        node = node_name(self.rank)
        self.mountpoint = Path(mounts.canonical(expand(cfg.mountpoint, self.rank, node)))
        local = Path(os.path.abspath(expand(cfg.local or default_parent(), self.rank, node)))
        catalog = self._load_catalog()
        owners = assemble.owners_of(catalog, self.size, cfg.replicas)
        owned = placement.owned_by(owners, self.rank)
        error = None
        try:
            check_mountpoint(self.mountpoint, cfg.nonempty, cfg.image)
            keep = Path(expand(cfg.keep, self.rank, node)) if cfg.keep else None
            store = PartitionStore(cfg.image, catalog, local, owned, cfg.keep_local, keep,
                                   cfg.keep_size)  # fmt: skip
            stack.callback(store.close)
        except FanfsError as e:
            error = e
        self.life.agree(error)  # every rank fails together, or none
        self.node = assemble.build(catalog, store, owners, self.rank, self.life.world, cfg,
                                   lambda: self.status().to_json())  # fmt: skip
        background = cfg.switches.background
        self.life.mount(stack, self.node.ops, self.mountpoint,
                        background=BACKGROUND if background is None else background,
                        before_unmount=self._before_unmount)  # fmt: skip
        self.node.pool.start(stack)  # stopped before the unmount (the stack is LIFO)
        log.info(
            "rank %d/%d: %d of %d partitions here (%d bytes), mount %s, local %s",
            self.rank, self.size, len(owned), catalog.n_partitions,
            sum(int(catalog.part_size[p]) for p in owned), self.mountpoint, local,
        )  # fmt: skip
        trio.run(self._serve)

    def _before_unmount(self) -> None:
        log.info("unmounting %s", self.mountpoint)
        if self.node is not None:
            self.node.pool.stop()  # it answers what is queued while the session exists

    async def _serve(self) -> None:
        assert self.node is not None
        n = self.node
        async with trio.open_nursery() as nursery:
            await nursery.start(self.life.watch_signals, self._on_stop)
            if n.transport is not None:
                await nursery.start(n.transport.run)
            nursery.start_soon(self._after_init)
            if n.pool.running:
                nursery.start_soon(n.pool.errors)
            nursery.start_soon(n.read_ahead.run)
            self.plan_socket = str(await nursery.start(n.plan_server.serve))
            # As each partition is staged, the fast path answers its files' READs alone, and
            # the data plane the peers' asks for them.
            n.store.start_staging(lambda p: n.pool.fast_part(p, n.store.fd(p), n.store.dfd(p)))
            self.serving = True
            if self.phase == "starting":
                self.phase = "serving"
            log.info("serving %s at %s (%s)", self.cfg.image, self.mountpoint,
                     "no_open" if fuse_ops.PATCHED else "keep_cache opens")  # fmt: skip
            await fuse_ops.serve()
            self.serving = False
            await self._stop_reading_ahead()  # before the session goes (pushers use it)
            self.phase = "lingering"
            self.life.unmount()
            if n.transport is not None:
                with self._linger_scope:
                    await n.transport.linger(self.cfg.linger)
                n.transport.stop()
            self.phase = "closing"
            nursery.cancel_scope.cancel()

    async def _stop_reading_ahead(self) -> None:
        if self.node is not None:
            await self.node.read_ahead.stop()

    async def _after_init(self) -> None:
        # The kernel sets the mount's readahead from FUSE INIT, which fuse_ops.serve answers
        # first: a value written before that is overwritten. INIT takes well under a second.
        await trio.sleep(1.0)
        _tune_readahead(self.mountpoint)
        if self.node is not None:
            f = self.node.pool.front_status()
            native.log_front(f.protocol, f.off, "requests")

    async def _on_stop(self, first: bool, nursery: trio.Nursery) -> None:
        if first:
            log.info("%s: shutting down", signal.Signals(self.life.stop_signal).name)
        await self._stop()

    async def _stop(self) -> None:
        """A stop signal, inside trio: end the FUSE session (read-ahead first, while READs
        are still answered), or, once unmounted, stop lingering for peers."""
        if self.phase in ("starting", "serving"):
            self.phase = "stopping"
            await self._stop_reading_ahead()
            fuse_ops.terminate()
        elif self.phase == "lingering":
            log.info("not waiting for peers any longer")
            self._linger_scope.cancel()
