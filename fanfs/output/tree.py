"""The output mount's namespace, in memory, and its files' bytes on the node's disk.

The namespace (names, directories, modes) lives here and nowhere else; a file's bytes live in
a local file, `o<data>`, in the daemon's private staging directory (mode 0700,
node/staging.py), opened relative to its fd. Renaming or unlinking under the mount changes
only the namespace.

Snapshots and holds: a put (journal.py) lands the first `size` bytes of a local file as they
were when it was taken (`snapshot`), so those bytes must not change until it lands: the put
holds its data below `size` (`hold`, `release`). A write below a hold, or a truncate below
it, first moves the file to new data (copy on write: view.py), whatever handles are open; a
write at or above it (an append) needs nothing. A local file goes once no node uses it and
no put holds it.

What changed since a file's last snapshot: `dirty` (anything: a create, a truncate, bytes),
`wrote` (bytes: a close then lands it), `low` (the lowest offset changed: the bytes below it,
up to the last snapshot's size, are the ones DEST has, so the next put may append).

A file whose write failed (ENOSPC, EIO: `poison`) is not put until it is truncated: DEST
keeps the last good version rather than a file with a hole.

A file whose bytes are at DEST and nowhere else (`data == 0`: evicted, view.py) is read back
from DEST when it is opened.

Concurrency: the trio thread only (view.py's operations); synchronous between awaits, so each
method is atomic with respect to the others.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from dataclasses import dataclass, field

from fanfs.output.dest import segments

ROOT = 1  # pyfuse3.ROOT_INODE
NAME_MAX = 255
UNCHANGED = 1 << 63  # `low` of a file with no change since its last snapshot


class TreeError(Exception):
    """A request the namespace refuses; `errno` says why."""

    def __init__(self, err: int):
        super().__init__(os.strerror(err))
        self.errno = err


@dataclass(slots=True, eq=False)
class Node:
    ino: int
    parent: int
    name: bytes
    is_dir: bool
    mode: int  # permission bits (no type)
    children: dict[bytes, int] = field(default_factory=dict)  # directories only
    linked: bool = True  # has a name (unlinked ones live on while open)
    opens: int = 0
    data: int = 0  # its local file, o<data> (files; 0: evicted, its bytes only at DEST)
    dirty: bool = False  # changed since its last snapshot
    wrote: bool = False  # bytes written since then (a close then lands it)
    low: int = UNCHANGED  # the lowest offset changed since then
    snap: int = 0  # the size of its last snapshot (0: none yet)
    failed: int = 0  # the errno of a write that failed, until truncated
    mtime_ns: int = field(default_factory=time.time_ns)  # directories' and evicted files'
    timed: bool = False  # a directory whose mtime the user set: DEST keeps the mount's

    # A node changes through these (the tree and the view call them).
    def add_child(self, name: bytes, ino: int) -> None:
        self.children[name] = ino
        self.mtime_ns = time.time_ns()

    def drop_child(self, name: bytes) -> None:
        del self.children[name]
        self.mtime_ns = time.time_ns()

    def move(self, parent: int, name: bytes) -> None:
        self.parent, self.name = parent, name

    def unname(self) -> None:
        self.linked = False

    def opened(self) -> None:
        self.opens += 1

    def closed(self) -> None:
        self.opens -= 1

    def use(self, data: int) -> None:
        self.data = data

    def chmod(self, mode: int) -> None:
        self.mode = mode & 0o777

    def touch(self, mtime_ns: int, timed: bool = False) -> None:
        self.mtime_ns = mtime_ns
        self.timed = self.timed or timed

    def poison(self, err: int) -> None:
        """A write failed: not landed until truncated to nothing (`poison(0)`)."""
        self.failed = err

    def changed(self, low: int, wrote: bool = False) -> None:
        """Something at and above offset `low` changed (UNCHANGED: only metadata)."""
        self.dirty = True
        self.low = min(self.low, low)
        self.wrote = self.wrote or wrote

    def snapshot(self, size: int) -> int:
        """A put takes the file as it is, `size` bytes: the leading bytes that did not change
        since its previous put (all of them if it had none: 0)."""
        keep = min(self.low, self.snap) if self.snap else 0
        self.snap, self.low, self.dirty, self.wrote = size, UNCHANGED, False, False
        return keep

    def unlanded(self, keep: int, dirty: bool = True) -> None:
        """Its last put did not land (journal.drop): its next one keeps no more than that
        (and, unless the user skipped it, it lands again)."""
        self.dirty = self.dirty or dirty
        self.low = min(self.low, keep)


class Tree:
    def __init__(self, staging_fd: int, mode: int = 0o755):
        self.fd = staging_fd
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, ROOT, b"", True, mode)}
        self._next = ROOT + 1
        self.files = 0
        self.bytes_written = 0
        self._holds: dict[int, list[int]] = {}  # data -> the sizes its pending puts hold
        self.used: set[int] = set()  # data of live files

    # -- lookups ---------------------------------------------------------------------------

    def node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise TreeError(errno.ENOENT) from None

    def dir(self, ino: int) -> Node:
        n = self.node(ino)
        if not n.is_dir:
            raise TreeError(errno.ENOTDIR)
        return n

    def child(self, parent: int, name: bytes) -> Node:
        ino = self.dir(parent).children.get(name)
        if ino is None:
            raise TreeError(errno.ENOENT)
        return self.nodes[ino]

    def lookup(self, path: bytes) -> Node | None:
        """The node at `path` (relative, as `path` gives it) now, if any."""
        n = self.nodes[ROOT]
        for name in path.split(b"/") if path else ():
            ino = n.children.get(name)
            if ino is None:
                return None
            n = self.nodes[ino]
        return n

    def describe(self, n: Node) -> str:
        """`n` in a message: its path, or "a removed file"."""
        return os.fsdecode(self.path(n.ino)) if n.linked else "a removed file"

    def path(self, ino: int) -> bytes:
        """Relative to the root (and to DEST): b"a/b/c"."""
        parts = []
        n = self.node(ino)
        while n.ino != ROOT:
            parts.append(n.name)
            n = self.nodes[n.parent]
        return b"/".join(reversed(parts))

    def files_under(self, ino: int) -> list[Node]:
        """The files at or below node `ino` (a rename of a directory moves them all)."""
        out, todo = [], [self.node(ino)]
        while todo:
            n = todo.pop()
            if n.is_dir:
                todo.extend(self.nodes[c] for c in n.children.values())
            else:
                out.append(n)
        return out

    # -- local files -----------------------------------------------------------------------

    @staticmethod
    def local_name(data: int) -> str:
        return f"o{data}"

    def open_local(self, data: int, flags: int = os.O_RDWR) -> int:
        return os.open(self.local_name(data), flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)

    def open_local_or_none(self, data: int) -> int | None:
        """For the lander and the replicas (any thread): the bytes, None once they are gone."""
        try:
            return self.open_local(data, os.O_RDONLY)
        except FileNotFoundError:
            return None

    def stat_local(self, n: Node) -> os.stat_result:
        return os.stat(self.local_name(n.data), dir_fd=self.fd, follow_symlinks=False)

    def new_data(self) -> int:
        """A new empty local file (made O_EXCL), for a new file or a copy on write."""
        data = self._next
        self._next += 1
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(self.local_name(data), flags, 0o600, dir_fd=self.fd))
        self.used.add(data)
        return data

    def _drop_data(self, data: int) -> None:
        if data and data not in self.used and not self._holds.get(data):
            self._holds.pop(data, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local_name(data), dir_fd=self.fd)

    def hold(self, data: int, size: int) -> None:
        """A put of the first `size` bytes of `data` is pending: they stay as they are."""
        self._holds.setdefault(data, []).append(size)

    def release(self, data: int, size: int) -> None:
        """That put landed (or was dropped)."""
        sizes = self._holds.get(data, [])
        with contextlib.suppress(ValueError):
            sizes.remove(size)
        self._drop_data(data)

    def held_below(self, data: int) -> int:
        """Writes below this offset of `data` must go to new data first (0: none)."""
        return max(self._holds.get(data) or [0])

    def copy_data(self, old: int, new: int, end: int) -> None:
        """The first `end` bytes of `old` into `new`, holes kept (a worker thread: both are the
        caller's until `use`)."""
        src, dst = self.open_local(old, os.O_RDONLY), self.open_local(new, os.O_WRONLY)
        try:
            for off, length in segments(src, 0, end):
                done = 0
                while done < length:
                    k = os.copy_file_range(src, dst, length - done, off + done, off + done)
                    if k == 0:
                        raise OSError(errno.EIO, "the local file is shorter than it was")
                    done += k
            os.ftruncate(dst, end)
        finally:
            os.close(src)
            os.close(dst)

    def use(self, n: Node, data: int) -> None:
        """`n` uses `data` from now on (0: evicted); its old data goes once no put holds it."""
        old = n.data
        n.use(data)
        if old:
            self.used.discard(old)
            self._drop_data(old)

    def discard_data(self, data: int) -> None:
        """New data that was not used (its copy failed)."""
        self.used.discard(data)
        self._drop_data(data)

    # -- changes ---------------------------------------------------------------------------

    def _free_name(self, parent: int, name: bytes) -> Node:
        d = self.dir(parent)
        if len(name) > NAME_MAX:
            raise TreeError(errno.ENAMETOOLONG)
        if name in d.children:
            raise TreeError(errno.EEXIST)
        return d

    def _add(self, d: Node, name: bytes, is_dir: bool, mode: int) -> Node:
        n = Node(self._next, d.ino, name, is_dir, stat.S_IMODE(mode) & 0o777)
        self._next += 1
        self.nodes[n.ino] = n
        d.add_child(name, n.ino)
        return n

    def mkdir(self, parent: int, name: bytes, mode: int) -> Node:
        return self._add(self._free_name(parent, name), name, True, mode)

    def create(self, parent: int, name: bytes, mode: int) -> Node:
        """A new empty file (its local file made O_EXCL); the caller opens it."""
        d = self._free_name(parent, name)
        data = self.new_data()
        n = self._add(d, name, False, mode)
        n.use(data)
        n.changed(0)
        self.files += 1
        return n

    def unlink(self, parent: int, name: bytes, want_dir: bool) -> Node:
        n = self.child(parent, name)
        if want_dir and not n.is_dir:
            raise TreeError(errno.ENOTDIR)
        if not want_dir and n.is_dir:
            raise TreeError(errno.EISDIR)
        if n.is_dir and n.children:
            raise TreeError(errno.ENOTEMPTY)
        self._drop_name(n)
        return n

    def _drop_name(self, n: Node) -> None:
        self.nodes[n.parent].drop_child(n.name)
        n.unname()
        self.forget_if_unused(n)

    def forget_if_unused(self, n: Node) -> None:
        """Free an inode with no name and no open handle (and its local file)."""
        if n.linked or n.opens:
            return
        self.nodes.pop(n.ino, None)
        if not n.is_dir:
            self.use(n, 0)
            self.files -= 1

    def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
               noreplace: bool) -> tuple[Node, Node | None]:  # fmt: skip
        """(the node renamed, the node it replaced if any)."""
        n = self.child(parent, name)
        nd = self.dir(new_parent)
        if len(new_name) > NAME_MAX:
            raise TreeError(errno.ENAMETOOLONG)
        if n.is_dir:  # not into itself or below
            p = nd
            while True:
                if p.ino == n.ino:
                    raise TreeError(errno.EINVAL)
                if p.ino == ROOT:
                    break
                p = self.nodes[p.parent]
        old_ino = nd.children.get(new_name)
        replaced = None
        if old_ino == n.ino:
            return n, None
        if old_ino is not None:
            if noreplace:
                raise TreeError(errno.EEXIST)
            replaced = self.nodes[old_ino]
            if replaced.is_dir and not n.is_dir:
                raise TreeError(errno.EISDIR)
            if n.is_dir and not replaced.is_dir:
                raise TreeError(errno.ENOTDIR)
            if replaced.is_dir and replaced.children:
                raise TreeError(errno.ENOTEMPTY)
            self._drop_name(replaced)
        self.nodes[n.parent].drop_child(n.name)
        n.move(nd.ino, new_name)
        nd.add_child(new_name, n.ino)
        return n, replaced
