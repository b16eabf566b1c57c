"""The output mount's pyfuse3 adapter: kernel requests in, calls on the view (view.py) out,
domain errors mapped to errnos; and its FUSE session options.

The dataset mount's adapter is node/fuse_ops.py; this is the output wing's own (an output
daemon is a process of its own), and it uses fuse_ops's session functions (mount, serve,
terminate, unmount) and its receiver hook. Together they are the only modules that import
pyfuse3.

POSIX for one writer per file: create, write, read back, truncate, rename (RENAME_NOREPLACE
too), unlink, mkdir, rmdir, chmod, utimes, fsync, statfs, mmap. Hard links, symlinks and
device nodes are refused (EPERM): DEST gets regular files and directories only.

Opens: write-only ones are direct_io: a writer's write() goes to the daemon as it is
(requests of up to 1 MiB: max_pages 256), with no FUSE page cache in between, whose pages
would be filled, throttled and written back at a cost of their own (a 2 GiB dd ran at 0.32 of
local disk with the writeback cache, 0.52 with direct_io; docs/performance.md); the front's
C thread answers each WRITE once its bytes are in memory (view.py). Read-only and read-write
opens use the page cache, dropped at every open (close-to-open, as NFS), so mmap works on
them: read-only mappings (np.load(mmap_mode="r"), safetensors) and shared writable ones
(np.memmap "w+", "r+"), whose pages the kernel writes back as WRITEs through the handle.

`statfs` answers DEST's: what a job can write is what DEST can take (view.py evicts landed
files from the node when it needs the room).
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
from fanfs.output.dest import LandingError
from fanfs.output.tree import ROOT, Node, TreeError
from fanfs.output.view import View

log = logging.getLogger(__name__)

assert ROOT == pyfuse3.ROOT_INODE
STATUS_XATTR = mounts.STATUS_XATTR.encode()
RETRY_XATTR = mounts.RETRY_XATTR.encode()
SKIP_XATTR = mounts.SKIP_XATTR.encode()
TIMEOUT_S = 60.0  # entries and attributes: only this daemon changes the namespace
BLKSIZE = 1 << 20  # st_blksize: writers size their buffers from it (1 MiB: one FUSE WRITE)
STATFS_S = 5.0  # DEST's statfs, at most this long (a hung DEST: the node's answer instead)
_RENAME_NOREPLACE = getattr(os, "RENAME_NOREPLACE", 1)
_WRITES = os.O_WRONLY | os.O_RDWR

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
        except LandingError as e:
            log.warning("%s: not at DEST: %s", handler.__name__, e)
            raise pyfuse3.FUSEError(errno.EIO) from None
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
    enable_writeback_cache = False  # direct_io for writers instead (module docstring)

    def __init__(self, view: View, status: Callable[[], dict[str, Any]]):
        super().__init__()
        self.view = view
        self.tree = view.tree
        self._status = status
        self.uid, self.gid = os.geteuid(), os.getegid()

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
            return a
        a.st_mode = stat.S_IFREG | n.mode
        a.st_nlink = 1 if n.linked else 0
        if n.data:
            st = self.tree.stat_local(n)
            a.st_size, a.st_blocks = st.st_size, st.st_blocks
            a.st_mtime_ns, a.st_ctime_ns, a.st_atime_ns = (
                st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns)  # fmt: skip
        else:  # evicted: what fanfs landed at DEST
            ident = self.view.lander.idents.get(n.ino)
            a.st_size, a.st_blocks = (ident.size, ident.blocks) if ident else (0, 0)
            a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = n.mtime_ns
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
        await self.view.setattr(
            n,
            mode=stat.S_IMODE(attr.st_mode) if fields.update_mode else None,
            size=attr.st_size if fields.update_size else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return self._attrs(n)

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
        return self._attrs(self.view.mkdir(parent, name, mode))

    @_edge
    async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
        self.view.remove(parent, name, want_dir=True)

    @_edge
    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        self.view.remove(parent, name, want_dir=False)

    @_edge
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:  # fmt: skip
        if flags & ~_RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)  # RENAME_EXCHANGE, WHITEOUT: not at DEST
        self.view.rename(parent_old, name_old, parent_new, name_new,
                         bool(flags & _RENAME_NOREPLACE))  # fmt: skip

    async def link(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)  # one name per file at DEST

    async def symlink(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)  # fanfs never writes (or follows) symlinks

    async def mknod(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EPERM)  # regular files and directories only

    # -- files -----------------------------------------------------------------------------

    @staticmethod
    def _info(fh: int, flags: int) -> pyfuse3.FileInfo:
        # Write-only: direct_io; anything that may read or map: the page cache, dropped at
        # open (module docstring).
        return pyfuse3.FileInfo(fh=fh, direct_io=flags & _WRITES == os.O_WRONLY,
                                keep_cache=False)  # fmt: skip

    @_edge
    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:  # fmt: skip
        fh, n = await self.view.create(parent, name, mode, flags)
        return self._info(fh, flags), self._attrs(n)

    @_edge
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        n = self.tree.node(inode)
        if n.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return self._info(await self.view.open(n, flags), flags)

    @_edge
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.view.read(fh, off, size)

    @_edge
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.view.write(fh, off, buf)

    @_edge
    async def flush(self, fh: int) -> None:
        await self.view.flush(fh)

    @_edge
    async def fsync(self, fh: int, datasync: bool) -> None:
        try:
            await self.view.fsync(fh)
        except LandingError as e:
            log.warning("fsync: not at DEST yet: %s", e)
            raise pyfuse3.FUSEError(errno.EIO) from None

    @_edge
    async def release(self, fh: int) -> None:
        await self.view.release(fh)

    # -- the rest --------------------------------------------------------------------------

    @_edge
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        v = None
        with trio.move_on_after(STATFS_S):
            try:
                v = await trio.to_thread.run_sync(self.view.dest.statvfs, abandon_on_cancel=True)
            except OSError as e:
                log.warning("statfs of DEST: %s", e)
        if v is None:
            v = os.statvfs(self.tree.fd)
        s = pyfuse3.StatvfsData()
        s.f_bsize, s.f_frsize = v.f_bsize, v.f_frsize
        s.f_blocks, s.f_bfree, s.f_bavail = v.f_blocks, v.f_bfree, v.f_bavail
        s.f_files, s.f_ffree, s.f_favail = v.f_files, v.f_ffree, v.f_favail
        s.f_namemax = 255
        return s

    @_edge
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENODATA)
        if name == RETRY_XATTR:  # `fanfs sync` or `umount`: everything written, now
            await self.view.put_all()
            self.view.lander.poke()
        elif name.startswith(SKIP_XATTR + b"."):  # `fanfs sync --skip`: the op failing now
            seq = name[len(SKIP_XATTR) + 1 :]
            if not seq.isdigit():
                raise pyfuse3.FUSEError(errno.ENODATA)
            return json.dumps({"skipped": self.view.lander.skip(int(seq))}).encode()
        elif name != STATUS_XATTR:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return json.dumps(self._status()).encode()

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
MOUNT_OPTIONS = {"subtype=fanfs-output", "default_permissions", "nosuid", "nodev"}


def mount_options(staging: str) -> set[str]:
    """The options, with the staging directory in the source field of the mount table (where
    `fanfs umount` finds what a dead daemon left): only a plain path is put there."""
    plain = all(c.isalnum() or c in "/._-" for c in staging)
    return MOUNT_OPTIONS | {f"fsname={mounts.OUTPUT_SOURCE}" + (f":{staging}" if plain else "")}
