"""The output mount's namespace, in memory, and its files' bytes on the node's disk.

The namespace (names, directories, modes) lives here and nowhere else; a file's bytes live in
one local file per inode, `o<inode>`, in the daemon's private staging directory (mode 0700,
node/staging.py), opened relative to its fd. Renaming or unlinking under the mount changes
only the namespace; the local file goes when its inode has no name and no open handle.

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


class Tree:
    def __init__(self, staging_fd: int, mode: int = 0o755):
        self.fd = staging_fd
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, ROOT, b"", True, mode)}
        self._next = ROOT + 1
        self.files = 0
        self.bytes_written = 0

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
    def local_name(ino: int) -> str:
        return f"o{ino}"

    def open_local(self, ino: int, flags: int = os.O_RDWR) -> int:
        return os.open(self.local_name(ino), flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)

    def open_local_or_none(self, ino: int) -> int | None:
        """For the lander (any thread): the file's bytes, None once its inode is gone."""
        try:
            return self.open_local(ino, os.O_RDONLY)
        except FileNotFoundError:
            return None

    def stat_local(self, ino: int) -> os.stat_result:
        return os.stat(self.local_name(ino), dir_fd=self.fd, follow_symlinks=False)

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
        fd = os.open(self.local_name(self._next),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.fd)  # fmt: skip
        os.close(fd)
        n = self._add(d, name, False, mode)
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local_name(n.ino), dir_fd=self.fd)
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
