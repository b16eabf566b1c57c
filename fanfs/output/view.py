"""The output view's core: what each request under an output mount does to the namespace
(tree.py), the journal (journal.py) and the local files; fs.py is its pyfuse3 adapter.

Handles: a handle (`fh`) is an fd of the daemon's: of the file's local data, or, for a file
whose bytes were evicted from the node and are read back, of its landed copy at DEST. The
front's C thread (fanfs/csrc/front.c, writes mode) writes WRITEs behind, through the fh, into
the local file (fanfs/csrc/writes.c); every other request reaches the view once they are in.
When a file moves to new data (copy on write, a truncate to nothing, a read back), every
handle of it is moved too, in place (dup3 onto the same fd number): readers and writers see
the file, not a version of it.

Landing (what a put is, when one is taken):
- at a close (FLUSH) after bytes were written, at the last close of a file only created or
  truncated, at `fsync` (which then waits until it is at DEST), at a truncate or a chmod of a
  closed file;
- at `fanfs sync` and at a stop signal: every file changed, open or not ("as it is");
- every `interval` seconds, for files open for appending (logs): a conditional put, which
  lands only as a new file or an append to fanfs's own earlier landing (dest.py), so a log
  reaches DEST while it is written, and no checkpoint being rewritten replaces the last good
  one before it is closed.
A put snapshots the file (`Node.snapshot`): its first `size` bytes are held (tree.py); a
write below that, through any handle, comes here instead of going behind (`lib.front_hold`),
and the file moves to a copy first. Appends need no copy.

Room on the node: a file that is closed, unchanged and landed may leave the node's disk
(`room`, least recently used first) when the staging file system has less than `reserve`
free; it is read back from DEST when opened again (for writing: copied back first). So what a
job can write is bounded by DEST, not by the node.

Concurrency: the trio thread only. A node's data moves under its lock (a trio.Lock made
when first needed): the copy runs in a worker thread, and every request that
touches the node's bytes waits for it. Everything between two awaits is atomic.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trio

from fanfs.native import lib
from fanfs.output import dest as dst
from fanfs.output.dest import Dest, LandingError, Result
from fanfs.output.front import WriteFront
from fanfs.output.journal import ATTR, MKDIR, PUT, RENAME, RMDIR, UNLINK, Journal, Op
from fanfs.output.lander import Lander
from fanfs.output.tree import ROOT, Node, Tree, TreeError

log = logging.getLogger(__name__)

EVERY_WRITE = (1 << 64) - 1  # lib.front_hold: every WRITE comes here
RESERVE_FRACTION, RESERVE_MAX = 0.2, 32 << 30  # free space kept on the node: 20 %, 32 GiB at most
READ_BACK_WAIT_S = 10.0  # a file read back waits this long for the renames before it to land


@dataclass(slots=True)
class Handle:
    node: int
    write: bool
    append: bool
    local: bool = True  # an fd of a local file (False: of the landed copy at DEST)

    def moved(self) -> None:
        """Its fd now names the file's local data (view._switch_locked)."""
        self.local = True


class View:
    def __init__(self, tree: Tree, journal: Journal, lander: Lander, dest: Dest, *,
                 front: WriteFront, reserve_fraction: float = RESERVE_FRACTION,
                 replicate: Callable[[int], Awaitable[None]] | None = None):  # fmt: skip
        self.tree = tree
        self.journal = journal
        self.lander = lander
        self.dest = dest
        self._front = front  # its C threads may write WRITEs behind (else all come here)
        self.reserve_fraction = reserve_fraction
        self.replicate = replicate  # replicas.py: return once the partner holds put `seq`
        self.handles: dict[int, Handle] = {}
        self._fhs: dict[int, set[int]] = {}  # node -> its handles
        self._locks: dict[int, trio.Lock] = {}  # node -> held while its data moves (open ones)
        self._waits: set[trio.CancelScope] = set()  # requests waiting on DEST
        self._stopping = False
        self._touched: set[int] = set()  # nodes opened or changed since they were last clean
        self.poisoned: set[int] = set()  # nodes whose last write failed
        self.evictable: OrderedDict[int, None] = OrderedDict()  # closed, clean, landed: LRU
        self.kept: list[Op] = []  # puts the user skipped: their bytes stay, held
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.read_back = 0
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
                lib.front_hold(fh, below)

    def _freeze(self, n: Node) -> None:
        """Every WRITE of `n` comes here from now on, and those answered are in the file."""
        writers = self._writers(n) if self._behind else []
        for fh in writers:
            lib.front_hold(fh, EVERY_WRITE)
        if writers:
            lib.front_settle()

    def collect(self, fh: int) -> Node | None:
        """The node behind handle `fh`, with what the front did through it since last asked:
        bytes written (from which offset), a write that failed (the node is poisoned)."""
        h = self.handles.get(fh)
        n = self.tree.nodes.get(h.node) if h is not None else None
        if not self._behind or n is None:
            return n
        low = lib.front_take_written(fh)
        if low is not None:
            n.changed(low, wrote=True)
        err = lib.front_take_error(fh)
        if err:
            log.warning("a write to %s failed: %s; it is not landed until it is written "
                        "again from the start", self._name(n), os.strerror(err))  # fmt: skip
            n.poison(err)
            self.poisoned.add(n.ino)
        return n

    def _collect_node(self, n: Node) -> None:
        for fh in list(self.fhs(n)):
            self.collect(fh)

    def _name(self, n: Node) -> str:
        return os.fsdecode(self.tree.path(n.ino)) if n.linked else "a removed file"

    def check_ops_room(self) -> None:
        if self.journal.full():
            raise TreeError(errno.ENOSPC)  # the journal's bound (memory)

    # -- files -----------------------------------------------------------------------------

    async def create(self, parent: int, name: bytes, mode: int, flags: int) -> tuple[int, Node]:
        self.check_ops_room()
        n = self.tree.create(parent, name, mode)
        self.journal.note({"name": os.fsdecode(self.tree.path(n.ino)), "node": n.ino,
                           "data": n.data})  # fmt: skip
        return await self.open(n, flags & ~os.O_TRUNC), n

    async def open(self, n: Node, flags: int) -> int:
        write = bool(flags & (os.O_WRONLY | os.O_RDWR))
        if write or flags & os.O_TRUNC:
            self.check_ops_room()
        n.opened()  # before any await: an unlink meanwhile must not free it under us
        self._touched.add(n.ino)
        self.evictable.pop(n.ino, None)
        try:
            async with self._lock(n):
                if flags & os.O_TRUNC:
                    await self._truncate_locked(n, 0)
                if not n.data and write:
                    await self._fetch_locked(n)
                if n.data:
                    fh, local = self.tree.open_local(n.data), True
                else:
                    fh, local = await self._open_landed(n), False
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
                lib.front_hold(fh, self.tree.held_below(n.data))
            self.room()
        return fh

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles[fh]
        if h.local:
            return os.pread(fh, size, off)
        with self._interruptible():  # DEST may be slow, or hang
            own = [os.dup(fh)]
            try:
                return await trio.to_thread.run_sync(_pread_own, own, size, off,
                                                     abandon_on_cancel=True)  # fmt: skip
            finally:
                _close_own(own)
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

    async def truncate(self, n: Node, size: int) -> None:
        async with self._lock(n):
            await self._truncate_locked(n, size)
        if not n.opens:
            await self.put(n)  # a closed file truncated: DEST sees it too
        self._idle(n)

    async def _truncate_locked(self, n: Node, size: int) -> None:
        if size == 0 and (not n.data or self.tree.held_below(n.data)):
            self._freeze(n)
            self._switch_locked(n, self.tree.new_data())  # nothing to copy
        elif not n.data:
            await self._fetch_locked(n)
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
                    lib.front_take_error(fh)
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

    async def _open_landed(self, n: Node) -> int:
        """An fd of the landed copy at DEST of a file evicted from the node (a rename of it
        still landing is waited for, a while)."""
        waited = False
        while True:
            ident = self.lander.idents.get(n.ino)
            if ident is None:
                raise TreeError(errno.EIO)
            try:
                with self._interruptible():
                    return await trio.to_thread.run_sync(
                        dst.open_landed, self.dest, self.tree.path(n.ino), ident,
                        abandon_on_cancel=True)  # fmt: skip
                raise LandingError("the daemon is stopping")
            except (OSError, LandingError) as e:
                if not waited and not self.lander.idle():
                    waited = True
                    with trio.move_on_after(READ_BACK_WAIT_S), self._interruptible():
                        await self.lander.wait_landed(self.journal.enqueued)
                    continue
                log.warning("%s: evicted from this node, and its copy at DEST cannot be read: "
                            "%s", self._name(n), e)  # fmt: skip
                raise TreeError(errno.EIO) from None

    async def _fetch_locked(self, n: Node) -> None:
        """An evicted file's bytes, copied back from DEST to the node (to be written)."""
        src = await self._open_landed(n)
        new = 0
        try:
            ident = self.lander.idents[n.ino]
            new = self.tree.new_data()
            out = self.tree.open_local(new, os.O_WRONLY)
            try:
                with self._interruptible():
                    own = [os.dup(src), os.dup(out)]
                    try:
                        await trio.to_thread.run_sync(_fetch_own, own, ident,
                                                      abandon_on_cancel=True)  # fmt: skip
                    finally:
                        _close_own(own)
                    self._switch_locked(n, new)
                    self.read_back += 1
                    return
                raise LandingError("the daemon is stopping")
            finally:
                os.close(out)
        except (OSError, LandingError, KeyError) as e:
            if new:
                self.tree.discard_data(new)
            log.warning("%s: its copy at DEST cannot be read back: %s", self._name(n), e)
            raise TreeError(errno.EIO) from None
        finally:
            os.close(src)

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[trio.CancelScope]:
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

    # -- landing ---------------------------------------------------------------------------

    async def put(self, n: Node, cond: bool = False) -> Op | None:
        """A snapshot of `n` for DEST (None if it cannot land: no name, a failed write)."""
        async with self._lock(n):
            put = self._put_locked(n, cond)
        return put[0] if put is not None else None

    def _put_locked(self, n: Node, cond: bool) -> tuple[Op, int] | None:
        """(the put, the seq the partner knows this snapshot by)."""
        self._collect_node(n)
        if n.is_dir or not n.linked or n.failed or not n.data:
            return None
        self._freeze(n)
        self._collect_node(n)  # what the queue held
        st = self.tree.stat_local(n)
        keep = n.snapshot(st.st_size)
        self.tree.hold(n.data, st.st_size)
        if self.replicate is not None:
            self.tree.hold(n.data, st.st_size)  # until the partner's copy is read (`sent`)
        op, old, sent = self.journal.put(n.ino, self.tree.path(n.ino), n.data, st.st_size, keep,
                                         n.mode, st.st_mtime_ns, cond)  # fmt: skip
        if old is not None:
            self.tree.release(old.data, old.size)
        self._hold(n)
        self.lander.wake()
        return op, sent

    async def put_all(self, cond: bool = False, appending: bool = False) -> int:
        """Snapshots of every file changed (`appending`: only those open for appending),
        open ones too, as they are. How many."""
        count = 0
        for ino in list(self._touched):
            n = self.tree.nodes.get(ino)
            if n is None or n.is_dir or not n.linked:
                continue
            if appending and not any(self.handles[fh].append for fh in self._writers(n)):
                continue
            self._collect_node(n)
            if (n.dirty if cond else self._unput(n)) and await self.put(n, cond) is not None:
                count += 1
            self._idle(n)
        return count

    async def flush(self, fh: int) -> None:
        # Every close() of a descriptor: if bytes were written, the writer is done with them
        # for now. Not for a create or a truncate alone: dd, say, closes a dup of a new file
        # before writing to it, and DEST would see the empty file first (RELEASE lands those).
        n = self.collect(fh)
        if n is None:
            return
        self._check(n, fh)
        if n.wrote:
            await self._put_replicated(n)

    async def _put_replicated(self, n: Node) -> Op | None:
        """A snapshot of `n`, once the partner holds it (replicas.py)."""
        async with self._lock(n):
            put = self._put_locked(n, cond=False)
        if put is not None and self.replicate is not None:
            await self.replicate(put[1])
        return put[0] if put is not None else None

    async def fsync(self, fh: int) -> None:
        """Returns once `fh`'s file is at DEST; LandingError if its landing failed once (or
        the daemon stops first)."""
        n = self.collect(fh)
        if n is None or not n.linked:
            return
        self._check(n, fh)
        self._collect_node(n)  # bytes written through its other handles count too
        op = await self._put_replicated(n) if self._unput(n) else self.journal.last_put(n.ino)
        if op is None:
            return
        self.lander.poke()  # a failing op is tried again now, for this fsync
        with self._interruptible():
            await self.lander.wait_landed(op.seq, give_up_after_failures=1)
            return
        raise LandingError("the daemon is stopping")

    def _check(self, n: Node, fh: int) -> None:
        """A close or fsync, through a handle for writing, of a file whose write failed
        fails too, every time (a reader's close does not)."""
        if n.failed and self.handles[fh].write:
            raise TreeError(n.failed)

    async def release(self, fh: int) -> None:
        n = self.collect(fh)
        h = self.handles.pop(fh, None)
        if self._behind:
            lib.front_hold(fh, 0)  # the fd number's next user starts with no hold
        os.close(fh)
        if n is None:
            return
        self.fhs(n).discard(fh)
        n.closed()
        if h is not None and h.write and not any(self.handles[f].write for f in self.fhs(n)):
            if self._unput(n) and n.linked:
                await self.put(n)  # changed after its last close (created or truncated, say)
            self.journal.note({"written": n.ino})  # after its put: recover.py lands that
        elif self._unput(n) and not n.opens:
            await self.put(n)
        self._idle(n)
        self.tree.forget_if_unused(n)
        if n.ino not in self.tree.nodes:
            self._touched.discard(n.ino)
        self.room()

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
        self._may_evict(n)

    # -- the namespace ---------------------------------------------------------------------

    def mkdir(self, parent: int, name: bytes, mode: int) -> Node:
        self.check_ops_room()
        n = self.tree.mkdir(parent, name, mode)
        self.journal.add(MKDIR, self.tree.path(n.ino), node=n.ino, mode=n.mode)
        self.lander.wake()
        return n

    def remove(self, parent: int, name: bytes, want_dir: bool) -> None:
        self.check_ops_room()
        n = self.tree.child(parent, name)
        path = self.tree.path(n.ino)
        self.tree.unlink(parent, name, want_dir)
        self._removed(n)
        self.journal.add(RMDIR if want_dir else UNLINK, path, node=n.ino)
        self.lander.wake()

    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
               noreplace: bool) -> None:  # fmt: skip
        self.check_ops_room()
        old = self.tree.path(self.tree.child(parent, name).ino)
        n, replaced = self.tree.rename(parent, name, new_parent, new_name, noreplace)
        if replaced is not None:
            self._removed(replaced)
        new = self.tree.path(n.ino)
        if new != old:
            self.journal.add(RENAME, old, new=new, node=n.ino,
                             replaced=replaced.ino if replaced is not None else 0)  # fmt: skip
            self.lander.wake()

    def _removed(self, n: Node) -> None:
        """`n` lost its name: its versions not landed yet never will be."""
        for op in self.journal.remove_node(n.ino):
            self.tree.release(op.data, op.size)
        self.evictable.pop(n.ino, None)
        if not n.opens:
            self._touched.discard(n.ino)

    async def setattr(self, n: Node, mode: int | None, size: int | None,
                      mtime_ns: int | None) -> None:  # fmt: skip
        self.check_ops_room()
        at_dest = n.linked and n.ino != ROOT  # DEST's own mode and times are the user's
        if mode is not None:
            n.chmod(mode)
            if at_dest:
                self.journal.add(ATTR, self.tree.path(n.ino), node=n.ino, mode=n.mode)
        if size is not None and not n.is_dir:
            await self.truncate(n, size)
        if mtime_ns is not None:
            n.touch(mtime_ns)
            if n.data and not n.is_dir:
                fd = self.tree.open_local(n.data, os.O_RDONLY)
                try:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
                finally:
                    os.close(fd)
            if at_dest:
                self.journal.add(ATTR, self.tree.path(n.ino), node=n.ino, mtime_ns=mtime_ns)
        self.lander.wake()

    # -- room on the node ------------------------------------------------------------------

    def _may_evict(self, n: Node) -> None:
        if n.data and not n.opens and not n.dirty and n.ino in self.lander.idents:
            self.evictable[n.ino] = None
            self.evictable.move_to_end(n.ino)

    def room(self) -> None:
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

    # -- the lander's hooks ----------------------------------------------------------------

    def landed(self, op: Op, result: Result) -> None:
        if op.kind == PUT:
            self.tree.release(op.data, op.size)
            n = self.tree.nodes.get(op.node)
            if n is not None:
                self._hold(n)
                self._may_evict(n)
            self.room()
        self.journal.compact(self.journal_files)

    def dropped(self, op: Op) -> None:
        """A conditional put that did not land (it would have replaced what is not ours)."""
        self.tree.release(op.data, op.size)
        n = self.tree.nodes.get(op.node)
        if n is not None:
            if self.journal.last_put(n.ino) is None:
                n.unlanded(op.keep)
                self._touched.add(n.ino)
            self._hold(n)

    def skipped(self, op: Op) -> None:
        """The user skipped this put: its bytes stay held, and are named at the end."""
        self.kept.append(op)
        n = self.tree.nodes.get(op.node)
        if n is not None and self.journal.last_put(n.ino) is None:
            n.unlanded(op.keep, dirty=False)

    # -- what the daemon asks --------------------------------------------------------------

    def writers_open(self) -> int:
        return sum(1 for h in self.handles.values() if h.write)

    def failed_files(self) -> list[str]:
        """Files whose last write failed: not landed (DEST keeps their last good version)."""
        nodes = [self.tree.nodes.get(ino) for ino in self.poisoned]
        return [self._name(n) for n in nodes if n is not None and n.linked and n.failed]

    def unlanded(self) -> dict[str, str]:
        """What is not at DEST: {DEST path: local file} (pending puts, files changed and not
        put)."""
        out = {os.fsdecode(op.path): self.tree.local_name(op.data)
               for op in self.journal.pending() if op.kind == PUT}  # fmt: skip
        for ino in self._touched:
            n = self.tree.nodes.get(ino)
            if n is not None and n.linked and n.dirty and n.data:
                out.setdefault(self._name(n), self.tree.local_name(n.data))
        return out

    def skipped_files(self) -> dict[str, str]:
        """Puts the user skipped: {DEST path: local file}."""
        return {os.fsdecode(op.path): self.tree.local_name(op.data) for op in self.kept
                if op.kind == PUT}  # fmt: skip

    def sent(self, node: int, data: int, size: int) -> None:
        """replicas.py sent the partner its copy of a put of `data`: that hold goes."""
        self.tree.release(data, size)
        n = self.tree.nodes.get(node)
        if n is not None:
            self._hold(n)
            self._may_evict(n)

    def journal_files(self) -> list[dict[str, Any]]:
        """recover.py's records of the files and directories that exist now, and of the puts
        the user skipped (a compacted journal)."""
        out: list[dict[str, Any]] = []
        for n in self.tree.nodes.values():
            if not n.linked or n.ino == ROOT:
                continue
            ident = self.lander.idents.get(n.ino)
            writing = any(self.handles[fh].write for fh in self.fhs(n))
            out.append({"file": n.ino, "path": self._name(n), "data": n.data,
                        "writing": writing,
                        "ident": ident.to_json() if ident else None})  # fmt: skip
        listed = {r["file"] for r in out}
        out.extend({"file": node, "path": "", "data": 0, "writing": False,
                    "ident": ident.to_json()}
                   for node, ident in self.lander.idents.items() if node not in listed)  # fmt: skip
        out.extend({"skipped": op.record()} for op in self.kept)
        return out

    def statistics(self) -> dict[str, Any]:
        return {"open_handles": len(self.handles), "failed_writes": self.failed_files()[:20],
                "evicted_files": self.evicted_files, "evicted_bytes": self.evicted_bytes,
                "read_back": self.read_back}  # fmt: skip


# A worker thread that a stop may abandon must not use an fd the event loop closes (its
# number could name another file by then): these take dups of them from `own`, a list only
# one side empties (list.pop is atomic), and close them; the loop closes what they did not take.
def _close_own(own: list[int]) -> None:
    while own:
        with contextlib.suppress(IndexError, OSError):
            os.close(own.pop())


def _pread_own(own: list[int], size: int, off: int) -> bytes:
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
