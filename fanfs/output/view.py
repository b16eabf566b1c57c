"""The output view's core: what each request under an output mount does to the namespace
(tree.py), the journal (journal.py) and the local files; fs.py is its pyfuse3 adapter. The
files' bytes and handles are its base's (files.py); room on the node is room.py's.

Landing (what a put is, when one is taken):
- at a close (FLUSH) after bytes were written, at the last close of a file only created or
  truncated, at `fsync` (which then waits until it is at DEST), at a truncate or a chmod of a
  closed file;
- at `fanfs sync` and at a stop signal: every file changed, open or not ("as it is");
- every `interval` seconds, for files open for appending (logs): a conditional put, which
  lands only as a new file or an append to fanfs's own earlier landing (apply.py), so a log
  reaches DEST while it is written, and no checkpoint being rewritten replaces the last good
  one before it is closed.
A put snapshots the file: its bytes are held until it lands (files.py).

Concurrency: the trio thread only (files.py: a node's data moves under its lock).
Everything between two awaits is atomic.
"""

from __future__ import annotations

import os
from typing import Any

from fanfs.output.dest import LandingError, Result
from fanfs.output.files import Files
from fanfs.output.journal import ATTR, MKDIR, PUT, RENAME, RMDIR, UNLINK, Op
from fanfs.output.tree import ROOT, Node, TreeError


class View(Files):
    # -- files -----------------------------------------------------------------------------

    async def create(self, parent: int, name: bytes, mode: int, flags: int) -> tuple[int, Node]:
        self.check_ops_room()
        n = self.tree.create(parent, name, mode)
        self.journal.note({"name": os.fsdecode(self.tree.path(n.ino)), "node": n.ino,
                           "data": n.data})  # fmt: skip
        return await self.open(n, flags & ~os.O_TRUNC), n

    async def truncate(self, n: Node, size: int) -> None:
        async with self._lock(n):
            await self._truncate_locked(n, size)
        if not n.opens:
            await self.put(n)  # a closed file truncated: DEST sees it too
        self._idle(n)

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
        with self.room.interruptible():
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
            self._front.hold(fh, 0)  # the fd number's next user starts with no hold
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
        self.room.make()

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
        self.room.keep(n)
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
            n.touch(mtime_ns, timed=at_dest and n.is_dir)  # DEST shows it from now on (dir_time)
            if n.data and not n.is_dir:
                fd = self.tree.open_local(n.data, os.O_RDONLY)
                try:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
                finally:
                    os.close(fd)
            if at_dest:
                self.journal.add(ATTR, self.tree.path(n.ino), node=n.ino, mtime_ns=mtime_ns)
        self.lander.wake()

    # -- the lander's hooks ----------------------------------------------------------------

    def dir_time(self, path: bytes) -> tuple[int, int] | None:
        """(node, mtime) that DEST's directory `path` must show again after a name in it
        landed: the mount's, for a directory whose time the user set (tar -x, rsync -a and
        cp -a set it after the directory's files, and a file's put can land after that)."""
        n = self.tree.lookup(path) if path else None
        return (n.ino, n.mtime_ns) if n is not None and n.timed else None

    def landed(self, op: Op, result: Result) -> None:
        if op.kind == PUT:
            self.tree.release(op.data, op.size)
            n = self.tree.nodes.get(op.node)
            if n is not None:
                self._hold(n)
                self.room.may_evict(n)
            self.room.make()
        self.journal.compact(self.journal_files)

    def dropped(self, op: Op) -> None:
        """A put that will not land: a conditional one (it would have replaced what is not
        ours; its file lands again later), or an orphaned one (its file lost its name while
        the put was failing: nothing of it is to land, so its node is not made dirty)."""
        self.tree.release(op.data, op.size)
        n = self.tree.nodes.get(op.node)
        if n is not None:
            if not op.orphaned and self.journal.last_put(n.ino) is None:
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
        return [self.tree.describe(n) for n in nodes if n is not None and n.linked and n.failed]

    def unlanded(self) -> dict[str, str]:
        """What is not at DEST: {DEST path: local file} (pending puts, files changed and not
        put)."""
        out = {os.fsdecode(op.path): self.tree.local_name(op.data)
               for op in self.journal.pending() if op.kind == PUT}  # fmt: skip
        for ino in self._touched:
            n = self.tree.nodes.get(ino)
            if n is not None and n.linked and n.dirty and n.data:
                out.setdefault(self.tree.describe(n), self.tree.local_name(n.data))
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
            self.room.may_evict(n)

    def journal_files(self) -> list[dict[str, Any]]:
        """recover.py's records of the files and directories that exist now, and of the puts
        the user skipped (a compacted journal)."""
        out: list[dict[str, Any]] = []
        for n in self.tree.nodes.values():
            if not n.linked or n.ino == ROOT:
                continue
            ident = self.lander.idents.get(n.ino)
            writing = any(self.handles[fh].write for fh in self.fhs(n))
            out.append({"file": n.ino, "path": self.tree.describe(n), "data": n.data,
                        "writing": writing,
                        "ident": ident.to_json() if ident else None})  # fmt: skip
        listed = {r["file"] for r in out}
        out.extend({"file": node, "path": "", "data": 0, "writing": False,
                    "ident": ident.to_json()}
                   for node, ident in self.lander.idents.items() if node not in listed)  # fmt: skip
        out.extend({"skipped": op.record()} for op in self.kept)
        return out

    def stop_waiting(self) -> None:
        """The daemon stops: every request waiting on DEST answers now (room.py)."""
        self.room.stop_waiting()

    def statistics(self) -> dict[str, Any]:
        r = self.room
        return {"open_handles": len(self.handles), "failed_writes": self.failed_files()[:20],
                "evicted_files": r.evicted_files, "evicted_bytes": r.evicted_bytes,
                "read_back": r.read_back}  # fmt: skip
