"""The mount daemon's lifecycle: validate, mount, serve, and always clean up.

Order (S3QL's mount.py): everything that can fail because of a user mistake (image, partitions,
mount point) is checked before anything is mounted. Each resource registers its cleanup on an
exit stack the moment it exists, so the unmount and the removal of staged copies happen whatever
ends the daemon: `fanfs umount` (SIGTERM), SIGINT, an external unmount, or an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from fanfs import mounts
from fanfs.catalog import Catalog
from fanfs.errors import MountFailed, MountpointError
from fanfs.fuse_ops import PATCHED, FanfsOperations
from fanfs.reader import Reader
from fanfs.store import PartitionStore

log = logging.getLogger(__name__)

# Readahead of the mount's bdi: with 1 MiB the kernel asks for big files in 1 MiB requests
# instead of 128 KiB ones (+17 to 28 % on 2 to 8 MiB files here, ENVIRONMENT.md).
READ_AHEAD_KB = 1024


@dataclass(frozen=True, slots=True)
class MountConfig:
    image: Path
    mountpoint: Path
    local: Path
    keep_local: bool = False
    cache_bytes: int = 512 << 20


def check_mountpoint(mountpoint: Path) -> None:
    if mounts.find(mountpoint) is not None:
        raise MountpointError(f"{mountpoint}: already mounted")
    if not mountpoint.exists():
        raise MountpointError(f"{mountpoint}: mount point does not exist")
    if not mountpoint.is_dir():
        raise MountpointError(f"{mountpoint}: mount point is not a directory")


def _tune_readahead(mountpoint: Path) -> None:
    entry = mounts.find(mountpoint)
    if entry is None:
        return
    try:
        Path(f"/sys/class/bdi/{entry.device}/read_ahead_kb").write_text(f"{READ_AHEAD_KB}\n")
    except OSError as e:  # not root, or no sysfs: a little slower, still correct
        log.debug("could not raise read_ahead_kb: %s", e)


class Daemon:
    def __init__(self, cfg: MountConfig):
        self.cfg = cfg
        self.started = time.time()
        self.serving = False
        self.catalog: Catalog | None = None
        self.store: PartitionStore | None = None
        self.reader: Reader | None = None

    def status(self) -> dict[str, Any]:
        assert self.catalog is not None and self.store is not None and self.reader is not None
        return {
            "pid": os.getpid(),
            "image": str(self.cfg.image),
            "mountpoint": str(self.cfg.mountpoint),
            "rank": 0,
            "size": 1,
            "host": os.uname().nodename,
            "serving": self.serving,
            "no_open": PATCHED,
            "uptime_s": round(time.time() - self.started, 3),
            "catalog": {
                "entries": self.catalog.n_entries,
                "files": int(self.catalog.is_file.sum()),
                "memory_bytes": self.catalog.memory_bytes(),
            },
            "store": self.store.statistics(),
            "reader": self.reader.statistics(),
        }

    def run(self) -> None:
        cfg = self.cfg
        catalog, _ = Catalog.load(cfg.image)
        self.catalog = catalog
        check_mountpoint(cfg.mountpoint)
        with contextlib.ExitStack() as stack:
            store = PartitionStore(
                cfg.image, catalog, cfg.local, range(catalog.n_partitions), cfg.keep_local
            )
            stack.callback(store.close)
            self.store = store
            self.reader = Reader(catalog, store, cfg.cache_bytes)
            ops = FanfsOperations(catalog, self.reader, self.status)
            options = set(pyfuse3.default_options)
            options |= {"fsname=fanfs", "subtype=fanfs", "ro", "default_permissions"}
            try:
                pyfuse3.init(ops, str(cfg.mountpoint), options)
            except RuntimeError as e:
                raise MountFailed(f"{cfg.mountpoint}: cannot mount: {e}") from None
            stack.callback(self._unmount)
            _tune_readahead(cfg.mountpoint)
            trio.run(self._serve)

    def _unmount(self) -> None:
        log.info("unmounting %s", self.cfg.mountpoint)
        pyfuse3.close(unmount=True)

    async def _serve(self) -> None:
        assert self.store is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals)
            self.store.start_staging()
            self.serving = True
            log.info(
                "serving %s at %s (%s)",
                self.cfg.image,
                self.cfg.mountpoint,
                "no_open" if PATCHED else "keep_cache opens",
            )
            await pyfuse3.main()
            self.serving = False
            nursery.cancel_scope.cancel()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                log.info("%s: shutting down", signal.Signals(signum).name)
                pyfuse3.terminate()
                return
