"""The node wing's front on the Python side: the C threads that take FUSE requests from the
kernel themselves (fanfs/csrc/front.c), what they need from the FUSE adapter, and their
status.

Concurrency: `start`, `drain` and `stop` run in the main thread around the trio run (the
pool's order: fanfs/node/pool.py); `statistics` in the trio thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from fanfs import native
from fanfs.image import catalog as cat
from fanfs.native import lib
from fanfs.node.cache import percentiles_ms
from fanfs.status import FrontStatus

log = logging.getLogger(__name__)

# The front's threads: twice the cores, 8 to 32 (csrc/front.h). A front thread waits out a
# peer's piece and one is kept for local files: with one per core, 4 readers of peers' files
# here sent a READ in seven to Python (and the MPI thread spun for it): 0.34 of native against
# 0.43 with 8 threads (docs/performance.md, "The daemons' CPU by thread").
FRONT_THREADS = max(8, min(32, 2 * (os.cpu_count() or 4)))
NO_LATENCIES = (np.zeros(0), 0.0)  # a front that never started: no READ times


class Front:
    """What the front (fanfs/csrc/front.c) needs from the FUSE adapter: `install(receiver,
    fd)` registers (None: removes) pyfuse3's receiver, `session_fd()` is the session's fd, and
    the attributes the adapter answers with (st_blksize, the cache timeout in seconds, uid,
    gid); `mine[p]`: this node holds partition p; `spin_us`: how long the leader polls the
    device after a request; `holders`: the ranks holding each partition (assemble.holders)
    and `rank` this daemon's, for READs of peers' files (fetched by the MPI thread);
    `pretend`: the protocol minor to rewrite the kernel's INIT to (Switches, 0: none)."""

    def __init__(self, install: Callable[[Any, int], None], session_fd: Callable[[], int],
                 blksize: int, timeout_s: int, mine: np.ndarray, spin_us: int,
                 holders: np.ndarray | None = None, rank: int = 0,
                 pretend: int = 0):  # fmt: skip
        self.install = install
        self.session_fd = session_fd
        self.blksize = blksize
        self.timeout_s = timeout_s
        self.mine = np.ascontiguousarray(mine, dtype=np.uint8)
        self.spin_us = spin_us
        self.holders = holders
        self.rank = rank
        self.pretend = pretend
        self.running = False
        self.off = ""  # why it could not start
        self.native: lib.Front | None = None  # the C front, once made (start)

    def give_catalog(self, c: cat.Catalog) -> lib.Meta:
        """The catalog as the C reads it (also without threads: the unit tests)."""
        columns = {"mode": c.mode, "mtime_ns": c.mtime_ns, "size": c.size, "blocks": c.blocks,
                   "name_off": c.name_off, "name_len": c.name_len, "child_start": c.child_start,
                   "child_count": c.child_count, "part": c.part, "nlink": c.nlink}  # fmt: skip
        arrays = {k: np.ascontiguousarray(v) for k, v in columns.items()}
        return lib.Meta(arrays, c.strings, self.mine, os.getuid(), os.getgid(), self.blksize,
                        self.timeout_s)  # fmt: skip

    def give_holders(self) -> None:
        """Tell the pool who holds each partition (after its fast table, before it is on)."""
        if self.holders is not None:
            lib.pool_fast_owners(self.holders, self.rank)

    def start(self, catalog: cat.Catalog, stack: contextlib.ExitStack) -> bool:
        """Start the front's threads on the session's fd and hand pyfuse3 its receiver; False
        (and a warning) if they cannot start: pyfuse3 reads the device itself."""
        try:
            self.native = lib.Front(self.give_catalog(catalog))
            self.native.pretend(self.pretend)
            ready = self.native.start(self.session_fd(), FRONT_THREADS, self.spin_us)
        except (OSError, ValueError) as e:
            log.warning("front threads unavailable, requests go through the event loop: %s", e)
            self.off = f"its threads could not start ({e})"
            return False
        stack.callback(self.native.close)  # after trio is done with the receiver's fd
        self.install(self.native.receiver(), ready)
        self.running = True
        return True

    def drain(self) -> None:
        """pyfuse3's loop has ended: requests the threads would hand it are answered EIO,
        the others as before (the pool's pusher may wait for a READ only they can answer)."""
        if self.running:
            assert self.native is not None
            self.native.drain()

    def stop(self) -> None:
        """pyfuse3 reads the device again; the threads stop."""
        if self.running:
            self.running = False
            self.install(None, -1)
            assert self.native is not None
            self.native.stop()

    def statistics(self) -> FrontStatus:
        protocol, why = native.front_kernel(self.native)
        latencies = self.native.latencies() if self.native is not None else NO_LATENCIES
        return FrontStatus(running=self.running, **lib.front_stats(self.native),
                           **lib.remote_stats(), read_ms=percentiles_ms(*latencies),
                           protocol=protocol,
                           off=self.off or why)  # fmt: skip
