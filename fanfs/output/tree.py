"""The output mount's namespace, in memory, and its files' bytes on the node's disk.

The namespace (names, directories, modes) lives here and nowhere else; a file's bytes live in
a local file, `o<data>`, in the daemon's private staging directory (mode 0700,
node/staging.py), opened relative to its fd. Renaming or unlinking under the mount changes
only the namespace.

A put (dest.py) lands the local file it names, as it is when it lands, so the bytes of a
put must not change until then: each put holds a reference to its data (`hold`, `release`),
and a file opened for writing while a put of its data is pending, and no other handle of it
is open, gets new data first (`new_data`, `copy_data`, `switch`: an empty local file for
O_TRUNC, a copy otherwise). Handles already open keep their data (their fds name it), so a
file written through several at once is not switched: the lander then sees the bytes change
under a put and skips it (dest.py), and the next close lands them. A local file goes when no
inode uses it (unlinked, not open) and no pending put holds it.

A file whose write failed (ENOSPC, EIO: `poison`) is not put until it is truncated: DEST
keeps the last good version rather than a file with a hole; every close and fsync of it
returns the error.

Every change that DEST must see is handed to the journal (lander.py) in the order it happens,
by the adapter (fs.py), with the path it has now: paths at DEST follow from the order alone.

Concurrency: the trio thread only (the adapter's handlers); synchronous between awaits, so each
method is atomic with respect to the others.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from dataclasses import dataclass, field

ROOT = 1  # pyfuse3.ROOT_INODE
NAME_MAX = 255


class TreeError(Exception):
    """A request the namespace refuses; `errno` says why."""

    def __init__(self, err: int):
        super().__init__(os.strerror(err))
        self.errno = err


@dataclass(slots=True)
class Node:
    ino: int
    parent: int
    name: bytes
    is_dir: bool
    mode: int  # permission bits (no type)
    children: dict[bytes, int] = field(default_factory=dict)  # directories only
    linked: bool = True  # has a name (unlinked ones live on while open)
    opens: int = 0
    dirty: bool = False  # changed since its last put was enqueued
    wrote: bool = False  # bytes written since then (a close then lands it)
    data: int = 0  # its local file, o<data> (files only)
    failed: int = 0  # the errno of a write that failed, until truncated
    mtime_ns: int = field(default_factory=time.time_ns)  # directories' (files': the local file's)

    # A node changes through these (the tree and the adapter call them).
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

    def mark(self, dirty: bool = True, wrote: bool = False) -> None:
        self.dirty = dirty
        self.wrote = wrote

    def chmod(self, mode: int) -> None:
        self.mode = stat.S_IMODE(mode) & 0o777
        self.dirty = True

    def touch(self, mtime_ns: int) -> None:
        self.mtime_ns = mtime_ns

    def use(self, data: int) -> None:
        self.data = data

    def poison(self, err: int) -> None:
        self.failed = err


class Tree:
    def __init__(self, staging_fd: int, mode: int = 0o755):
        self.fd = staging_fd
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, ROOT, b"", True, mode)}
        self._next = ROOT + 1
        self.files = 0
        self.bytes_written = 0
        self.held: dict[int, int] = {}  # data -> pending puts of it
        self.used: set[int] = set()  # data of live files

    def wrote(self, n: int) -> None:
        self.bytes_written += n

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

    def path(self, ino: int) -> bytes:
        """Relative to the root (and to DEST): b"a/b/c"."""
        parts = []
        n = self.node(ino)
        while n.ino != ROOT:
            parts.append(n.name)
            n = self.nodes[n.parent]
        return b"/".join(reversed(parts))

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

    def _new_data(self) -> int:
        data = self._next
        self._next += 1
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(self.local_name(data), flags, 0o600, dir_fd=self.fd))
        self.used.add(data)
        return data

    def _drop_data(self, data: int) -> None:
        if data not in self.used and not self.held.get(data):
            self.held.pop(data, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local_name(data), dir_fd=self.fd)

    def hold(self, data: int) -> None:
        """A put of `data` is pending: its bytes stay as they are."""
        self.held[data] = self.held.get(data, 0) + 1

    def release(self, data: int) -> None:
        """That put landed (or was dropped)."""
        self.held[data] = self.held.get(data, 1) - 1
        self._drop_data(data)

    def needs_new_data(self, n: Node) -> bool:
        """Whether `n` must get new data before it is written: a pending put holds its bytes."""
        return bool(self.held.get(n.data))

    def new_data(self) -> int:
        """An empty local file for `switch` (`copy_data` fills it, in a worker thread)."""
        return self._new_data()

    def copy_data(self, old: int, new: int) -> None:
        """`old`'s bytes into `new` (any thread: both are the caller's until `switch`)."""
        src, dst = self.open_local(old, os.O_RDONLY), self.open_local(new, os.O_WRONLY)
        try:
            size, copied = os.fstat(src).st_size, 0
            while copied < size:
                k = os.copy_file_range(src, dst, size - copied, copied, copied)
                if k == 0:
                    break
                copied += k
        finally:
            os.close(src)
            os.close(dst)

    def switch(self, n: Node, new: int) -> None:
        """`n` uses `new` from now on; its old data goes once no put holds it."""
        old = n.data
        n.use(new)
        self.used.discard(old)
        self._drop_data(old)

    def discard_data(self, data: int) -> None:
        """New data that was not switched to (its copy failed)."""
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
        data = self._new_data()
        n = self._add(d, name, False, mode)
        n.use(data)
        n.mark()
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
            self.used.discard(n.data)
            self._drop_data(n.data)
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
