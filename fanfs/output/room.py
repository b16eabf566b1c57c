"""Room on the output node's disk: a file that is closed, unchanged and landed may leave it,
and is read back from DEST when opened again (view.py, files.py). So what a job can write is
bounded by DEST, not by the node.

Eviction: least recently used first, while the staging file system has less free than the
reserve (RESERVE_FRACTION of it, RESERVE_MAX at most); a file goes only if DEST still holds
exactly what fanfs landed for it, no put of it is pending, no snapshot holds its bytes and
they are not moving (`moving`: a copy under its lock).

Reading back: an fd of the landed copy at DEST (a rename of it still landing is waited for,
READ_BACK_WAIT_S), or its bytes copied back into a new local file (to be written). DEST may
be slow or hang: every wait on it is `interruptible`, and `stop_waiting` (the daemon stops)
answers them all at once, instead of holding the unmount up.

Concurrency: the trio thread only; the copies run in worker threads that a stop may abandon
(they use fds of their own: `close_own`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator

import trio

from fanfs.output import dest as dst
from fanfs.output.dest import Dest, LandingError
from fanfs.output.journal import Journal
from fanfs.output.lander import Lander
from fanfs.output.tree import Node, Tree, TreeError

log = logging.getLogger(__name__)

RESERVE_FRACTION, RESERVE_MAX = 0.2, 32 << 30  # free space kept on the node: 20 %, 32 GiB at most
READ_BACK_WAIT_S = 10.0  # a file read back waits this long for the renames before it to land


class Room:
    """`tree`'s files that may leave the node, and their way back from `dest`; `moving(n)`:
    whether `n`'s bytes are moving now (view.py's lock)."""

    def __init__(self, tree: Tree, journal: Journal, lander: Lander, dest: Dest,
                 moving: Callable[[Node], bool],
                 reserve_fraction: float = RESERVE_FRACTION):  # fmt: skip
        self.tree = tree
        self.journal = journal
        self.lander = lander
        self.dest = dest
        self._moving = moving
        self.reserve_fraction = reserve_fraction
        self.evictable: OrderedDict[int, None] = OrderedDict()  # closed, clean, landed: LRU
        self._waits: set[trio.CancelScope] = set()  # requests waiting on DEST
        self._stopping = False
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.read_back = 0

    # -- leaving the node ------------------------------------------------------------------

    def may_evict(self, n: Node) -> None:
        if n.data and not n.opens and not n.dirty and n.ino in self.lander.idents:
            self.evictable[n.ino] = None
            self.evictable.move_to_end(n.ino)

    def keep(self, n: Node) -> None:
        """`n` is in use (opened), or gone: not evictable (until `may_evict` again)."""
        self.evictable.pop(n.ino, None)

    def make(self) -> None:
        """Evict closed files that are at DEST, least recently used first, while the node's
        disk has less free than the reserve."""
        if not self.evictable:
            return
        try:
            v = os.statvfs(self.tree.fd)
        except OSError:
            return
        free = v.f_bavail * v.f_frsize
        reserve = min(v.f_blocks * v.f_frsize * self.reserve_fraction, RESERVE_MAX)
        while free < reserve and self.evictable:
            ino, _ = self.evictable.popitem(last=False)
            n = self.tree.nodes.get(ino)
            if n is None or not self._evictable(n):
                continue
            st = self.tree.stat_local(n)
            n.touch(st.st_mtime_ns)
            self.tree.use(n, 0)
            self.evicted_files += 1
            self.evicted_bytes += st.st_size
            free += st.st_blocks * 512

    def _evictable(self, n: Node) -> bool:
        ident = self.lander.idents.get(n.ino)
        return bool(n.data and n.linked and not n.opens and not n.dirty and not n.failed
                    and ident is not None and self.journal.last_put(n.ino) is None
                    and not self.tree.held_below(n.data) and not self._moving(n)
                    and ident.size == self.tree.stat_local(n).st_size)  # fmt: skip

    # -- coming back -----------------------------------------------------------------------

    async def open_landed(self, n: Node) -> int:
        """An fd of the landed copy at DEST of a file evicted from the node (a rename of it
        still landing is waited for, a while)."""
        waited = False
        while True:
            ident = self.lander.idents.get(n.ino)
            if ident is None:
                raise TreeError(errno.EIO)
            try:
                with self.interruptible():
                    return await trio.to_thread.run_sync(
                        dst.open_landed, self.dest, self.tree.path(n.ino), ident,
                        abandon_on_cancel=True)  # fmt: skip
                raise LandingError("the daemon is stopping")
            except (OSError, LandingError) as e:
                if not waited and not self.lander.idle():
                    waited = True
                    with trio.move_on_after(READ_BACK_WAIT_S), self.interruptible():
                        await self.lander.wait_landed(self.journal.enqueued)
                    continue
                log.warning("%s: evicted from this node, and its copy at DEST cannot be read: "
                            "%s", self.tree.describe(n), e)  # fmt: skip
                raise TreeError(errno.EIO) from None

    async def fetch_locked(self, n: Node, switch: Callable[[Node, int], None]) -> None:
        """An evicted file's bytes, copied back from DEST to the node (to be written); the
        file then uses them (`switch(n, new data)`, under `n`'s lock)."""
        src = await self.open_landed(n)
        new = 0
        try:
            ident = self.lander.idents[n.ino]
            new = self.tree.new_data()
            out = self.tree.open_local(new, os.O_WRONLY)
            try:
                with self.interruptible():
                    own = [os.dup(src), os.dup(out)]
                    try:
                        await trio.to_thread.run_sync(_fetch_own, own, ident,
                                                      abandon_on_cancel=True)  # fmt: skip
                    finally:
                        close_own(own)
                    switch(n, new)
                    self.read_back += 1
                    return
                raise LandingError("the daemon is stopping")
            finally:
                os.close(out)
        except (OSError, LandingError, KeyError) as e:
            if new:
                self.tree.discard_data(new)
            log.warning("%s: its copy at DEST cannot be read back: %s", self.tree.describe(n), e)
            raise TreeError(errno.EIO) from None
        finally:
            os.close(src)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[trio.CancelScope]:
        """A wait on DEST that a stop cuts short (`stop_waiting`): the request in it answers
        instead of holding the unmount up."""
        with trio.CancelScope() as scope:
            if self._stopping:
                scope.cancel()
            self._waits.add(scope)
            try:
                yield scope
            finally:
                self._waits.discard(scope)

    def stop_waiting(self) -> None:
        """The daemon stops: every request waiting on DEST answers now (EIO), and new ones
        do not wait."""
        self._stopping = True
        for scope in list(self._waits):
            scope.cancel()


# A worker thread that a stop may abandon must not use an fd the event loop closes (its
# number could name another file by then): these take dups of them from `own`, a list only
# one side empties (list.pop is atomic), and close them; the loop closes what they did not take.
def close_own(own: list[int]) -> None:
    while own:
        with contextlib.suppress(IndexError, OSError):
            os.close(own.pop())


def pread_own(own: list[int], size: int, off: int) -> bytes:
    fd = own.pop()
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def _fetch_own(own: list[int], ident: dst.Ident) -> None:
    out, src = own.pop(), own.pop()
    try:
        dst.fetch(src, out, ident)
    finally:
        os.close(src)
        os.close(out)
