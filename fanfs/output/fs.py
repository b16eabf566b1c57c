"""The output mount's pyfuse3 adapter: kernel requests in, calls on the tree and the journal,
FUSEError out; and its FUSE session (mount, serve, terminate, unmount).

The dataset mount's adapter is node/fuse_ops.py; this is the output wing's own (an output
daemon is a process of its own), and it uses fuse_ops's session functions (mount, serve,
terminate, unmount) and its receiver hook. Together they are the only modules that import
pyfuse3.

POSIX for one writer: create, write, read back, truncate, rename (RENAME_NOREPLACE too), unlink,
mkdir, rmdir, chmod, utimes, fsync, statfs. Hard links, symlinks and device nodes are refused
(EPERM): DEST gets regular files and directories only. A file's bytes go to its local file
(tree.py) as they are written; when it is closed (FLUSH) after a change, a put is enqueued
(lander.py), and with replicas the close returns once the partner node holds a copy
(replicas.py). `fsync` enqueues a put too and returns once the file is at DEST (EIO if landing
it failed; the journal keeps retrying).

Writes: every open is direct_io, so a writer's write() goes to the daemon as it is (requests
of up to 1 MiB: max_pages 256), with no FUSE page cache in between (whose pages would be
filled, throttled and written back at a cost of their own: a 2 GiB dd ran at 0.32 of local
disk with the writeback cache, 0.52 with direct_io; docs/performance.md). The daemon's
handles are fds of the local files (fh is the fd), and the front's C thread (fanfs/csrc/
front.c, writes mode) answers each WRITE as soon as its bytes are in the daemon's memory; a
writer thread puts them into the file in order (fanfs/csrc/writes.c), and every other request
comes here only once they are there. FLUSH asks which handles were written and whether a
write behind failed (`lib.front_take_written`, `lib.front_take_error`): the close then fails
with that errno (ENOSPC, EIO), as a local file system reports write-back errors. Reads are
direct too (a page cache of the mount could hold pages older than a direct write); mmap of a
file under the mount is refused (ENODEV).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from fanfs import mounts
from fanfs.native import lib
from fanfs.output.dest import MKDIR, PUT, RENAME, RMDIR, UNLINK, LandingError, Op
from fanfs.output.lander import Lander
from fanfs.output.tree import ROOT, Node, Tree, TreeError

log = logging.getLogger(__name__)

assert ROOT == pyfuse3.ROOT_INODE
STATUS_XATTR = mounts.STATUS_XATTR.encode()
RETRY_XATTR = mounts.RETRY_XATTR.encode()
TIMEOUT_S = 60.0  # entries and attributes: only this daemon changes the namespace
BLKSIZE = 1 << 20  # st_blksize: writers size their buffers from it (1 MiB: one FUSE WRITE)
FSYNC_GIVE_UP = 1  # fsync answers EIO after the put's first failed attempt (landing goes on)
_RENAME_NOREPLACE = getattr(os, "RENAME_NOREPLACE", 1)

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _edge(handler: Handler) -> Handler:
    """Map the core's errors to errnos; anything unexpected is logged once and is EIO."""

    @functools.wraps(handler)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except TreeError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS):
                raise pyfuse3.FUSEError(e.errno) from None
            log.warning("%s: %s", handler.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapped  # type: ignore[return-value]


class OutputOperations(pyfuse3.Operations):
    enable_writeback_cache = False  # direct_io instead (module docstring)

    def __init__(self, tree: Tree, lander: Lander, status: Callable[[], dict[str, Any]],
                 replicate: Callable[[Op], Awaitable[None]] | None = None):  # fmt: skip
        super().__init__()
        self.tree = tree
        self.lander = lander
        self._status = status
        self.handles: dict[int, int] = {}  # fh (an fd of the local file) -> inode
        self.writers: set[int] = set()  # handles opened for writing
        self.flushed: set[int] = set()  # handles closed (FLUSH) since their last write
        self.poisoned: set[int] = set()  # inodes whose last write failed (not walked per status)
        self.uid, self.gid = os.geteuid(), os.getegid()
        # Awaited after a put is enqueued at close: replicas.py sends the partner a copy.
        self.replicate = replicate

    # -- attributes ------------------------------------------------------------------------

    def _attrs(self, n: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = n.ino
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_blksize = BLKSIZE
        a.entry_timeout = a.attr_timeout = TIMEOUT_S
        if n.is_dir:
            a.st_mode = stat.S_IFDIR | n.mode
            a.st_nlink = 2
            a.st_size = 0
            a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = n.mtime_ns
        else:
            st = self.tree.stat_local(n)
            a.st_mode = stat.S_IFREG | n.mode
            a.st_nlink = 1 if n.linked else 0
            a.st_size = st.st_size
            a.st_blocks = st.st_blocks
            a.st_mtime_ns, a.st_ctime_ns, a.st_atime_ns = (
                st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns)  # fmt: skip
        return a

    @_edge
    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if name == b".":
            return self._attrs(self.tree.dir(parent))
        if name == b"..":
            return self._attrs(self.tree.nodes[self.tree.dir(parent).parent])
        return self._attrs(self.tree.child(parent, name))

    @_edge
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attrs(self.tree.node(inode))

    @_edge
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: Any) -> pyfuse3.EntryAttributes:  # fmt: skip
        n = self.tree.node(inode)
        if (fields.update_uid and attr.st_uid != self.uid) or \
                (fields.update_gid and attr.st_gid != self.gid):  # fmt: skip
            raise pyfuse3.FUSEError(errno.EPERM)  # DEST files are the writer's own
        if fields.update_mode:
            n.chmod(attr.st_mode)
        if not n.is_dir:
            if fields.update_size:
                await self._truncate(n, attr.st_size)
            if fields.update_mtime or fields.update_atime:
                st = self.tree.stat_local(n)
                fd = self.tree.open_local(n.data, os.O_RDONLY)
                try:
                    os.utime(fd, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                     attr.st_mtime_ns if fields.update_mtime
                                     else st.st_mtime_ns))  # fmt: skip
                finally:
                    os.close(fd)
                n.mark()
        elif fields.update_mtime:
            n.touch(attr.st_mtime_ns)
        if n.dirty and not n.opens and not n.is_dir:
            self._put(n)  # a truncate or chmod of a closed file: DEST sees it too
        return self._attrs(n)

    async def _truncate(self, n: Node, size: int) -> None:
        """Through the node's data, not a handle's: a handle may name data a put holds."""
        await self._writable(n, truncate=size == 0)
        fd = self.tree.open_local(n.data, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        if size == 0:  # nothing left of a failed write: its marks go too
            for fh in self._handles_of(n):
                lib.front_take_error(fh)
            n.poison(0)
            self.poisoned.discard(n.ino)
        n.mark()

    async def _writable(self, n: Node, truncate: bool) -> None:
        """Before `n` is written: new data if a pending put holds its bytes and no handle of
        it is open (tree.py says why); the copy runs in a worker thread."""
        if not self.tree.needs_new_data(n) or self._handles_of(n):
            return
        old, new = n.data, self.tree.new_data()
        try:
            if not truncate:
                await trio.to_thread.run_sync(self.tree.copy_data, old, new)
        except BaseException:
            self.tree.discard_data(new)
            raise
        if n.data == old and not self._handles_of(n):
            self.tree.switch(n, new)
        else:
            self.tree.discard_data(new)

    def _handles_of(self, n: Node) -> list[int]:
        return [fh for fh, ino in self.handles.items() if ino == n.ino]

    # -- directories -----------------------------------------------------------------------

    @_edge
    async def opendir(self, inode: int, ctx: Any) -> int:
        self.tree.dir(inode)
        return inode

    @_edge
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        d = self.tree.dir(fh)
        # Offsets are positions in the sorted names: stable enough for one writer (a name
        # added or removed meanwhile may be seen or missed, as POSIX allows).
        names = sorted(d.children)
        for i in range(start_id, len(names)):
            n = self.tree.nodes[d.children[names[i]]]
            if not pyfuse3.readdir_reply(token, names[i], self._attrs(n), i + 1):
                return

    @_edge
    async def releasedir(self, fh: int) -> None:
        return None

    @_edge
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        self._room()
        n = self.tree.mkdir(parent, name, mode)
        self.lander.enqueue(MKDIR, self.tree.path(n.ino), mode=n.mode)
        return self._attrs(n)

    @_edge
    async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
        self._remove(parent, name, want_dir=True)

    @_edge
    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        self._remove(parent, name, want_dir=False)

    def _remove(self, parent: int, name: bytes, want_dir: bool) -> None:
        self._room()
        path = self.tree.path(self.tree.child(parent, name).ino)
        self.tree.unlink(parent, name, want_dir)
        self.lander.enqueue(RMDIR if want_dir else UNLINK, path)

    @_edge
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:  # fmt: skip
        if flags & ~_RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)  # RENAME_EXCHANGE, WHITEOUT: not at DEST
        self._room()
        old = self.tree.path(self.tree.child(parent_old, name_old).ino)
        n, _ = self.tree.rename(parent_old, name_old, parent_new, name_new,
                                bool(flags & _RENAME_NOREPLACE))  # fmt: skip
        new = self.tree.path(n.ino)
        if new != old:
            self.lander.enqueue(RENAME, old, new)

    async def link(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)  # one name per file at DEST

    async def symlink(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)  # fanfs never writes (or follows) symlinks

    async def mknod(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)  # regular files and directories only

    # -- files -----------------------------------------------------------------------------

    def _room(self) -> None:
        if self.lander.full():
            raise pyfuse3.FUSEError(errno.ENOSPC)  # the journal's bound (memory)

    async def _open_fh(self, n: Node, flags: int) -> int:
        writes = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC))
        if flags & os.O_TRUNC:
            await self._truncate(n, 0)
        elif writes:
            await self._writable(n, truncate=False)
        fd = self.tree.open_local(n.data)
        self.handles[fd] = n.ino
        if writes:
            self.writers.add(fd)
        n.opened()
        return fd

    @_edge
    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:  # fmt: skip
        self._room()
        n = self.tree.create(parent, name, mode)
        fi = pyfuse3.FileInfo(fh=await self._open_fh(n, flags), direct_io=True)
        return fi, self._attrs(n)

    @_edge
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        n = self.tree.node(inode)
        if n.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            self._room()
        return pyfuse3.FileInfo(fh=await self._open_fh(n, flags), direct_io=True)

    @_edge
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    @_edge
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        n = os.pwrite(fh, buf, off)
        node = self.tree.nodes.get(self.handles.get(fh, 0))
        self.flushed.discard(fh)
        if node is not None:
            node.mark(wrote=True)
        self.tree.wrote(n)
        return n

    def _written(self, fh: int) -> Node | None:
        """The node behind handle `fh`, marked changed if the front wrote through it, and
        poisoned if a write behind through it failed (the front has put every write answered
        so far into its file before it forwards this request)."""
        n = self.tree.nodes.get(self.handles.get(fh, 0))
        if lib.front_take_written(fh):
            self.flushed.discard(fh)
            if n is not None:
                n.mark(wrote=True)
        err = lib.front_take_error(fh)
        if err and n is not None:
            log.warning("a write to %s failed: %s; it is not landed until it is written "
                        "again from the start", self._name(n), os.strerror(err))  # fmt: skip
            n.poison(err)
            self.poisoned.add(n.ino)
        return n

    def _check(self, n: Node | None, fh: int) -> None:
        """A close or fsync, through a handle for writing, of a file whose write failed
        fails too, every time (a reader's close does not)."""
        if n is not None and n.failed and fh in self.writers:
            raise pyfuse3.FUSEError(n.failed)

    def _refresh(self, n: Node) -> None:
        """What the front knows of every handle of `n`: written, failed."""
        for fh in self._handles_of(n):
            self._written(fh)

    def failed_files(self) -> list[str]:
        """Files whose last write failed: not landed (DEST keeps their last good version)."""
        nodes = [self.tree.nodes.get(ino) for ino in self.poisoned]
        return [os.fsdecode(self.tree.path(n.ino)) for n in nodes
                if n is not None and n.linked and n.failed]  # fmt: skip

    def _name(self, n: Node | None) -> str:
        return os.fsdecode(self.tree.path(n.ino)) if n is not None and n.linked else "a file"

    def _put(self, n: Node) -> Op | None:
        """Enqueue `n`'s bytes for DEST (if it still has a name and no failed write); the
        put holds its data until it lands."""
        self._refresh(n)
        if not n.linked or n.failed:
            return None
        n.mark(False)
        size = self.tree.stat_local(n).st_size
        op = self.lander.enqueue(PUT, self.tree.path(n.ino), ino=n.data, mode=n.mode, size=size)
        self.tree.hold(n.data)
        return op

    def put_settled(self) -> int:
        """Enqueue the files changed whose every handle has been closed since it was last
        written (a file created or truncated and closed, whose RELEASE has not come yet): a
        sync or an unmount must not miss them, nor land a file still being written. How
        many."""
        settled = []
        for n in self.tree.nodes.values():
            if n.is_dir or not n.dirty or not n.linked:
                continue
            self._refresh(n)
            if not n.failed and all(fh in self.flushed for fh in self._handles_of(n)):
                settled.append(n)
        for n in settled:
            self._put(n)
        return len(settled)

    @_edge
    async def flush(self, fh: int) -> None:
        # Every close() of a descriptor (the kernel has written its dirty pages first): if
        # bytes were written, the writer is done with them for now. Not for a create or a
        # truncate alone: dd, say, closes a dup of a new file before writing to it, and DEST
        # would see the empty file first (RELEASE lands those).
        n = self._written(fh)
        self._check(n, fh)
        self.flushed.add(fh)
        if n is not None and n.wrote:
            op = self._put(n)
            if op is not None and self.replicate is not None:
                await self.replicate(op)

    @_edge
    async def fsync(self, fh: int, datasync: bool) -> None:
        n = self._written(fh)
        self._check(n, fh)
        if n is None or not n.linked:
            return
        op = self._put(n)
        if op is None:
            return
        if self.replicate is not None:
            await self.replicate(op)
        try:
            await self.lander.wait_landed(op.seq, give_up_after_failures=FSYNC_GIVE_UP)
        except LandingError as e:
            log.warning("fsync: not at DEST yet: %s", e)
            raise pyfuse3.FUSEError(errno.EIO) from None

    @_edge
    async def release(self, fh: int) -> None:
        n = self._written(fh)
        self.handles.pop(fh, None)
        self.writers.discard(fh)
        self.flushed.discard(fh)
        os.close(fh)
        if n is None:
            return
        n.closed()
        if n.dirty and not n.opens:
            self._put(n)  # changed after its last close (a write through mmap, say)
        self.tree.forget_if_unused(n)

    # -- the rest --------------------------------------------------------------------------

    @_edge
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        v = os.statvfs(self.tree.fd)
        s = pyfuse3.StatvfsData()
        s.f_bsize, s.f_frsize = v.f_bsize, v.f_frsize
        s.f_blocks, s.f_bfree, s.f_bavail = v.f_blocks, v.f_bfree, v.f_bavail
        s.f_files, s.f_ffree, s.f_favail = v.f_files, v.f_ffree, v.f_favail
        s.f_namemax = 255
        return s

    @_edge
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode == ROOT and name in (STATUS_XATTR, RETRY_XATTR):
            if name == RETRY_XATTR:  # `fanfs sync` or `umount`: what is closed, now
                self.put_settled()
                self.lander.poke()
            return json.dumps(self._status()).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return []

    async def setxattr(self, *args: Any) -> None:
        raise pyfuse3.FUSEError(errno.ENOTSUP)  # DEST gets bytes, modes and times

    async def removexattr(self, *args: Any) -> None:
        raise pyfuse3.FUSEError(errno.ENOTSUP)

    async def forget(self, inode_list: Any) -> None:
        return None


# -- the session: the dataset mount's (node/fuse_ops.py), with this mount's options ----------
# nosuid, nodev as the dataset mount, but writable; default_permissions: the kernel checks modes.
MOUNT_OPTIONS = {"fsname=fanfs-output", "subtype=fanfs-output", "default_permissions",
                 "nosuid", "nodev"}  # fmt: skip
