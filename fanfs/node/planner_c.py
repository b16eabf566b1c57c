"""The read-ahead engine's C path (fanfs/node/planner.py): which files the C reads ahead, and
the calls that read, check, decode and store them with no Python per byte.

A file stored whole in a partition staged here is read as a READ reads it (from the page cache
when it holds the whole file, else with O_DIRECT: no second copy of the file in the page
cache), checked, decoded and stored into the kernel's page cache by fanfs_pool_push_file, in
the pusher's thread with the GIL let go. A peer's small file the data plane fetches
(fanfs/csrc/plane.c) goes the same way, its piece fetched into the pool's cache as a front
READ's is; several of them asked together go through fanfs_pool_push_files. Stores go
through a FUSE device descriptor of the engine's own (`open`, `close`): once the session has
closed its own, a late store reaches a dead connection, never a file that reused the number.

Concurrency: `open` and `close` are the event loop's, before the pushers start and after they
have all stopped; the rest is called from any pusher thread (read-only looks at the pool's
kinds and the store).
"""

from __future__ import annotations

import os

from fanfs.image import catalog as cat
from fanfs.native import lib
from fanfs.node.jobs import job as native_job
from fanfs.node.jobs import whole_piece
from fanfs.node.pool import NativePool
from fanfs.node.sources import Sources


def stored_in_c(done: int) -> bool | None:
    """fanfs_pool_push_file's answer `done` as `CReads.push` returns it."""
    if done == lib.EREMOTE:
        return None
    if done > 0:
        raise OSError(done, os.strerror(done))
    return done == 0


class CReads:
    def __init__(self, catalog: cat.Catalog, sources: Sources, pool: NativePool):
        self.catalog = catalog
        self.sources = sources
        self.pool = pool
        self.device = -1  # the FUSE device's descriptor for the stores, -1: none

    def open(self) -> None:
        """Take a descriptor of the running front's session for the stores (none: no C)."""
        front = self.pool.front
        device = front.session_fd() if front is not None else -1
        if device >= 0 and front is not None and front.running:
            self.device = os.dup(device)

    def close(self) -> None:
        """Once no pusher can store any more."""
        if self.device >= 0:
            os.close(self.device)
            self.device = -1

    def reads(self, entry: int) -> bool:
        """Whether the C may read `entry` ahead: a front to store with, a file its pool
        answers."""
        kinds = self.pool.kinds
        return self.device >= 0 and kinds is not None and kinds[entry] != lib.FAST_NO

    def direct(self, entry: int) -> bool:
        """Whether `job` reads `entry` with O_DIRECT when the page cache does not hold it: a
        file of this daemon's, in a partition staged where O_DIRECT works. The engine does not
        advise the kernel to read such a file ahead: the advice would cost the event loop the
        page cache's pages for it (about 0.2 ms a MiB here) and leave a second copy of it."""
        local = self.sources.local
        if not (self.reads(entry) and local.mine(entry)):
            return False
        part = local.where(entry)[0]
        return local.staged(part) and local.dfd(part) >= 0

    def by_plane(self, entry: int) -> bool:
        """Whether the data plane fetches a peer's file for `push` or `push_together` (no
        Python on either side)."""
        return self.reads(entry) and not self.sources.mine(entry) and self.plane_takes(entry)

    def plane_takes(self, entry: int) -> bool:
        """... of those the C reads and peers hold, the ones the data plane fetches."""
        return self.sources.plane and int(self.catalog.stored_len[entry]) <= lib.REMOTE_MAX

    def push(self, entry: int) -> bool | None:
        """Read (or fetch from a peer, `by_plane`), check, decode and store a file all in C,
        in this thread (fanfs_pool_push_file): True stored, False the kernel does not know it
        yet (nothing read), None where the C does not read it (no front, not staged yet, a
        file the front's pool leaves to Python, a peer's file no holder gave in time).
        OSError if the read, check, decode or store failed."""
        one = self.job(entry)
        return None if one is None else stored_in_c(lib.pool_push_file(one, self.device))

    def push_together(self, jobs: list[tuple[int, ...]]) -> list[int]:
        """fanfs_pool_push_files for native jobs (`job`): each one's answer, as `stored_in_c`
        reads it. Raises if they could not be asked."""
        return lib.pool_push_files(jobs, self.device)

    def job(self, entry: int) -> tuple[int, ...] | None:
        """`push`'s native job for `entry`, or None where the C does not read it."""
        c, local = self.catalog, self.sources.local
        if not self.reads(entry):
            return None
        part = local.where(entry)[0]
        dfd = -1
        if local.mine(entry):
            if not local.staged(part):
                return None
            fd, dfd = local.fd(part), local.dfd(part)  # read as a READ reads it (`direct`)
        elif self.plane_takes(entry):
            fd = lib.remote_fd(part)  # fetched into the pool's cache as the front's READ is
        else:
            return None
        return native_job(fd, dfd, entry, 0, 0, int(c.size[entry]), 0,
                          [whole_piece(c, entry, int(fd < 0))])  # fmt: skip
