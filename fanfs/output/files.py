"""A file's bytes on the output node, and the handles that reach them: the base of the view
(view.py), which adds what requests do to the namespace, the journal and the landings.

Handles: a handle (`fh`) is an fd of the daemon's: of the file's local data, or, for a file
whose bytes were evicted from the node and are read back (room.py), of its landed copy at
DEST. The front's C thread (fanfs/csrc/front.c, writes mode) writes WRITEs behind, through
the fh, into the local file (fanfs/csrc/writes.c); every other request reaches the view once
they are in (`collect`).

Moves: when a file moves to new data (copy on write, a truncate to nothing, a read back),
every handle of it is moved too, in place (dup3 onto the same fd number): readers and
writers see the file, not a version of it. A put snapshots the file (`Node.snapshot`): its
first `size` bytes are held (tree.py); a write below that, through any handle, comes here
instead of going behind (`WriteFront.hold`), and the file moves to a copy first. Appends need
no copy.

Concurrency: the trio thread only. A node's data moves under its lock (a trio.Lock made
when first needed): the copy runs in a worker thread, and every request that
touches the node's bytes waits for it. Everything between two awaits is atomic.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from fanfs.output.dest import Dest, LandingError
from fanfs.output.front import WriteFront
from fanfs.output.journal import Journal, Op
from fanfs.output.lander import Lander
from fanfs.output.room import RESERVE_FRACTION, Room, close_own, pread_own
from fanfs.output.tree import Node, Tree, TreeError

log = logging.getLogger(__name__)

EVERY_WRITE = (1 << 64) - 1  # WriteFront.hold: every WRITE comes here


@dataclass(slots=True)
class Handle:
    node: int
    write: bool
    append: bool
    local: bool = True  # an fd of a local file (False: of the landed copy at DEST)

    def moved(self) -> None:
        """Its fd now names the file's local data (view._switch_locked)."""
        self.local = True


class Files:
    """The bytes of `tree`'s files and the handles to them (module docstring); `front`: the
    C threads that may write behind; `replicate`: with replicas, returns once the partner
    holds a put."""

    def __init__(self, tree: Tree, journal: Journal, lander: Lander, dest: Dest, *,
                 front: WriteFront, reserve_fraction: float = RESERVE_FRACTION,
                 replicate: Callable[[int], Awaitable[None]] | None = None):  # fmt: skip
        self.tree = tree
        self.journal = journal
        self.lander = lander
        self.dest = dest
        self._front = front  # its C threads may write WRITEs behind (else all come here)
        self.replicate = replicate  # replicas.py: return once the partner holds put `seq`
        self.room = Room(tree, journal, lander, dest, self._moving, reserve_fraction)
        self.handles: dict[int, Handle] = {}
        self._fhs: dict[int, set[int]] = {}  # node -> its handles
        self._locks: dict[int, trio.Lock] = {}  # node -> held while its data moves (open ones)
        self._touched: set[int] = set()  # nodes opened or changed since they were last clean
        self.poisoned: set[int] = set()  # nodes whose last write failed
        self.kept: list[Op] = []  # puts the user skipped: their bytes stay, held
        self.bytes_written = 0  # through this module (the front counts its own)

    # -- helpers ---------------------------------------------------------------------------

    @property
    def _behind(self) -> bool:
        """The front's threads wrote WRITEs behind in this mount (they did from its start;
        after they stop, what they wrote is still collected)."""
        return self._front.started

    def _lock(self, n: Node) -> trio.Lock:
        lock = self._locks.get(n.ino)
        if lock is None:
            lock = self._locks[n.ino] = trio.Lock()
        return lock

    def _moving(self, n: Node) -> bool:
        lock = self._locks.get(n.ino)
        return lock is not None and lock.locked()

    def fhs(self, n: Node) -> set[int]:
        return self._fhs.get(n.ino, set())

    def _writers(self, n: Node) -> list[int]:
        return [fh for fh in self.fhs(n) if self.handles[fh].write]

    def _hold(self, n: Node) -> None:
        """Tell the front which WRITEs of `n` must come here: those below its held bytes."""
        if self._behind:
            below = self.tree.held_below(n.data) if n.data else 0
            for fh in self._writers(n):
                self._front.hold(fh, below)

    def _freeze(self, n: Node) -> None:
        """Every WRITE of `n` comes here from now on, and those answered are in the file."""
        writers = self._writers(n) if self._behind else []
        for fh in writers:
            self._front.hold(fh, EVERY_WRITE)
        if writers:
            self._front.settle()

    def collect(self, fh: int) -> Node | None:
        """The node behind handle `fh`, with what the front did through it since last asked:
        bytes written (from which offset), a write that failed (the node is poisoned)."""
        h = self.handles.get(fh)
        n = self.tree.nodes.get(h.node) if h is not None else None
        if not self._behind or n is None:
            return n
        low = self._front.take_written(fh)
        if low is not None:
            n.changed(low, wrote=True)
        err = self._front.take_error(fh)
        if err:
            log.warning("a write to %s failed: %s; it is not landed until it is written "
                        "again from the start", self.tree.describe(n),
                        os.strerror(err))  # fmt: skip
            n.poison(err)
            self.poisoned.add(n.ino)
        return n

    def _collect_node(self, n: Node) -> None:
        for fh in list(self.fhs(n)):
            self.collect(fh)

    def check_ops_room(self) -> None:
        if self.journal.full():
            raise TreeError(errno.ENOSPC)  # the journal's bound (memory)

    # -- a file's bytes ---------------------------------------------------------------------

    async def open(self, n: Node, flags: int) -> int:
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if write or flags & os.O_TRUNC:
            self.check_ops_room()
        n.opened()  # before any await: an unlink meanwhile must not free it under us
        self._touched.add(n.ino)
        self.room.keep(n)
        try:
            async with self._lock(n):
                if flags & os.O_TRUNC:
                    await self._truncate_locked(n, 0)
                if not n.data and write:
                    await self.room.fetch_locked(n, self._switch_locked)
                if n.data:
                    fh, local = self.tree.open_local(n.data), True
                else:
                    fh, local = await self.room.open_landed(n), False
        except BaseException:
            n.closed()
            self._idle(n)
            self.tree.forget_if_unused(n)
            raise
        self.handles[fh] = Handle(n.ino, write, bool(flags & os.O_APPEND), local)
        self._fhs.setdefault(n.ino, set()).add(fh)
        if write:
            if not any(self.handles[f].write for f in self.fhs(n) if f != fh):
                self.journal.note({"writing": n.ino})  # recover.py: kept if it dies now
            if self._behind:
                self._front.hold(fh, self.tree.held_below(n.data))
            self.room.make()
        return fh

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles[fh]
        if h.local:
            return os.pread(fh, size, off)
        with self.room.interruptible():  # DEST may be slow, or hang
            own = [os.dup(fh)]
            try:
                return await trio.to_thread.run_sync(pread_own, own, size, off,
                                                     abandon_on_cancel=True)  # fmt: skip
            finally:
                close_own(own)
        raise LandingError("the daemon is stopping")

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        """A WRITE the front did not take: below a hold (a copy first), or no front at all."""
        h = self.handles[fh]
        n = self.tree.node(h.node)
        async with self._lock(n):
            if off < self.tree.held_below(n.data):
                await self._copy_locked(n)
            k = os.pwrite(fh, buf, off)
        n.changed(off, wrote=True)
        self.bytes_written += k
        return k

    async def _truncate_locked(self, n: Node, size: int) -> None:
        if size == 0 and (not n.data or self.tree.held_below(n.data)):
            self._freeze(n)
            self._switch_locked(n, self.tree.new_data())  # nothing to copy
        elif not n.data:
            await self.room.fetch_locked(n, self._switch_locked)
        elif size < self.tree.held_below(n.data):
            await self._copy_locked(n, size)
        fd = self.tree.open_local(n.data, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        n.changed(size)
        if size == 0 and n.failed:  # nothing left of a failed write: its marks go too
            for fh in self.fhs(n):
                if self._behind:
                    self._front.take_error(fh)
            n.poison(0)
            self.poisoned.discard(n.ino)

    async def _copy_locked(self, n: Node, end: int | None = None) -> None:
        """Copy on write: `n` moves to a copy of its data (the first `end` bytes), so what
        its pending puts hold stays as it is."""
        self._freeze(n)
        size = self.tree.stat_local(n).st_size
        end = size if end is None else min(end, size)
        new = self.tree.new_data()
        try:
            await trio.to_thread.run_sync(self.tree.copy_data, n.data, new, end)
        except BaseException:
            self.tree.discard_data(new)
            self._hold(n)
            raise
        self._switch_locked(n, new)

    def _switch_locked(self, n: Node, new: int) -> None:
        """`n` uses `new` from now on, and so does every handle of it (same fd numbers)."""
        try:
            fd = self.tree.open_local(new)
        except OSError:
            self.tree.discard_data(new)
            self._hold(n)
            raise
        try:
            for fh in self.fhs(n):
                os.dup2(fd, fh, inheritable=False)
                self.handles[fh].moved()
        finally:
            os.close(fd)
        self.tree.use(n, new)
        if n.linked:
            self.journal.note({"name": os.fsdecode(self.tree.path(n.ino)), "node": n.ino,
                               "data": new})  # fmt: skip
        self._hold(n)

    def _unput(self, n: Node) -> bool:
        """Whether `n` has changes no unconditional put holds (a conditional put may not
        land: a close, a sync or an fsync lands the file whatever DEST holds)."""
        pending = self.journal.last_put(n.ino)
        return n.dirty or (pending is not None and pending.cond)

    def _idle(self, n: Node) -> None:
        """`n` may have no handle and no change any more: what it needed goes."""
        if n.opens:
            return
        self._fhs.pop(n.ino, None)
        lock = self._locks.get(n.ino)
        if lock is not None and not lock.locked() and not lock.statistics().tasks_waiting:
            del self._locks[n.ino]
        if not self._unput(n):
            self._touched.discard(n.ino)
        self.room.may_evict(n)
