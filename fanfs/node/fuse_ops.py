"""The pyfuse3 adapter: kernel requests in, calls on the catalog and reader, FUSEError out.

Nothing else in fanfs imports pyfuse3: the daemon mounts, serves and unmounts through the
session functions at the end of this module, which also hand the native read pool its hook.
Handlers raise only `FUSEError` (anything else would end pyfuse3's main loop); domain errors
are mapped here, once.

Speed: the data never changes while mounted, so every reply tells the kernel to keep it for as
long as the mount lives (entry/attr timeouts, keep_cache). With pyfuse3 patched by
tools/install_pyfuse3.py, `open` answers ENOSYS: the kernel then stops sending OPEN and RELEASE
and sends READ with handle 0, which the patch turns into the inode. File handles are always the
inode, so `read` means the same with or without the patch.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import pyfuse3

from fanfs import mounts
from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.node.jobs import INODE_BASE, NativeJob
from fanfs.node.reader import Reader

log = logging.getLogger(__name__)

CACHE_TIMEOUT_S = 365 * 24 * 3600.0  # "forever": the image cannot change under a mount
# The status attribute (mounts.STATUS_XATTR) on the root; never listed by listxattr or readdir.
STATUS_XATTR = mounts.STATUS_XATTR.encode()
BLKSIZE = 128 << 10  # st_blksize: tools like cp size their buffers from it
ROOT = pyfuse3.ROOT_INODE  # inode = entry + ROOT (entry 0 is the root directory)
assert ROOT == INODE_BASE  # the native pool's jobs name inodes the same way
# The level of tools/install_pyfuse3.py's patch this fanfs needs (its one definition: the
# installer reads it from here and writes it into the build as pyfuse3.FANFS_PATCH).
PATCH_LEVEL = 14
PATCHED = bool(getattr(pyfuse3, "FANFS_READ_PASSES_INODE", False))
# pyfuse3 can hand READs to the native read pool (its read hook).
READ_HOOK = getattr(pyfuse3, "FANFS_PATCH", 0) >= PATCH_LEVEL and hasattr(pyfuse3, "set_read_hook")

_ACCMODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


async def _erofs(*args: Any, **kwargs: Any) -> NoReturn:
    raise pyfuse3.FUSEError(errno.EROFS)


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def _edge(handler: Handler) -> Handler:
    """The one place where errors become errnos. A handler that raised anything but FUSEError
    would end pyfuse3's main loop, i.e. the whole mount for every reader: a corrupt file is
    EIO (logged once by the reader), anything unexpected is EIO too, logged with its trace."""

    @functools.wraps(handler)
    async def guarded(self: FanfsOperations, *args: Any) -> Any:
        try:
            return await handler(self, *args)
        except pyfuse3.FUSEError:
            raise
        except CorruptFile:
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            log.exception("%s%r failed, answering EIO", handler.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return guarded  # type: ignore[return-value]


class FanfsOperations(pyfuse3.Operations):
    def __init__(self, catalog: cat.Catalog, reader: Reader, status: Callable[[], dict[str, Any]]):
        super().__init__()
        self.catalog = catalog
        self.reader = reader
        self.status = status
        self.no_open = PATCHED
        self.uid = os.getuid()
        self.gid = os.getgid()

    # -- metadata: all from memory ---------------------------------------------------------

    def _entry(self, inode: int) -> int:
        entry = inode - ROOT
        if not 0 <= entry < self.catalog.n_entries:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return entry

    def _attrs(self, entry: int) -> pyfuse3.EntryAttributes:
        c = self.catalog
        a = pyfuse3.EntryAttributes()
        a.st_ino = entry + ROOT
        a.st_mode = int(c.mode[entry])
        a.st_nlink = int(c.nlink[entry])
        a.st_uid = self.uid
        a.st_gid = self.gid
        size = int(c.size[entry])
        a.st_size = size
        a.st_blksize = BLKSIZE
        a.st_blocks = int(c.blocks[entry])  # the source's allocation: sparse files stay sparse
        mtime = int(c.mtime_ns[entry])
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = mtime
        a.entry_timeout = CACHE_TIMEOUT_S
        a.attr_timeout = CACHE_TIMEOUT_S
        return a

    @_edge
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._entry(parent_inode)
        if name == b".":
            return self._attrs(parent)
        if name == b"..":
            return self._attrs(int(self.catalog.parent[parent]))
        entry = self.catalog.lookup(parent, name) if self.catalog.is_dir[parent] else None
        if entry is None:
            # A negative entry cached "forever" too: the tree cannot change.
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0
            a.entry_timeout = CACHE_TIMEOUT_S
            return a
        self.reader.looked_up(entry)
        return self._attrs(entry)

    @_edge
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(self._entry(inode))

    @_edge
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        entry = self._entry(inode)
        if not stat.S_ISLNK(int(self.catalog.mode[entry])):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return self.catalog.symlink_target(entry)

    @_edge
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        entry = self._entry(inode)
        if not self.catalog.is_dir[entry]:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_edge
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # start_id is the position in the listing (".", "..", then the children), so readdir
        # resumes with no state. Loaders that walk the tree (os.scandir) skip the two dots.
        entry = self._entry(fh)
        children = self.catalog.children(entry)
        dots = ((b".", entry), (b"..", int(self.catalog.parent[entry])))
        for pos in range(start_id, len(children) + 2):
            if pos < 2:
                name, child = dots[pos]
            else:
                child = children[pos - 2]
                name = self.catalog.name(child)
            if not pyfuse3.readdir_reply(token, name, self._attrs(child), pos + 1):
                return

    @_edge
    async def releasedir(self, fh: int) -> None:
        pass

    @_edge
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        c = self.catalog
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = int(c.size[c.is_file].sum()) // 4096 + 1
        s.f_bfree = s.f_bavail = 0
        s.f_files = c.n_entries
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    @_edge
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == ROOT and name == STATUS_XATTR:
            return json.dumps(self.status(), sort_keys=True).encode()
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @_edge
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []  # the status attribute stays hidden, so cp -a / rsync -X never copy it

    # -- data ------------------------------------------------------------------------------

    @_edge
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS or (flags & _ACCMODE) != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        entry = self._entry(inode)
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # kernel: no more OPEN/RELEASE, keep cache
        if not self.catalog.is_file[entry]:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    # pyfuse3's stub says bytes; its C code takes any buffer, and a memoryview slice of a
    # cached file saves one copy per request.
    @_edge
    async def read(  # type: ignore[override]
        self, fh: int, off: int, size: int
    ) -> bytes | memoryview | NativeJob:
        # A NativeJob tuple is answered by pyfuse3's native read pool (see fanfs.node.reader).
        return await self.reader.read(self._entry(fh), off, size)

    @_edge
    async def release(self, fh: int) -> None:
        pass

    @_edge
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    # -- every write-type operation: read-only file system ---------------------------------
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs
    create = write = setxattr = removexattr = fsync = fsyncdir = _erofs

    @_edge
    async def flush(self, fh: int) -> None:
        # Nothing to flush on a read-only file system. ENOSYS (rather than success) tells the
        # kernel so once and for all ("no_flush"): otherwise every close() is a round trip.
        raise pyfuse3.FUSEError(errno.ENOSYS)


# -- the session: the daemon's only way to pyfuse3 -------------------------------------------
# nosuid, nodev: a hostile image cannot offer a set-uid program or a device node (a root
# daemon's mount would otherwise honour both).
MOUNT_OPTIONS = {"fsname=fanfs", "subtype=fanfs", "ro", "default_permissions", "nosuid", "nodev"}


# pyfuse3 keeps one session in a module global and frees it in `close`; `terminate` and
# `notify_store` after that dereference a NULL session (a segfault, not an exception). So the
# session's state is kept here, and every call that needs the session asks it first. Changed
# only by the daemon's trio thread (mount, unmount); read by pusher threads, for which a
# stale True is harmless: the daemon stops them before it unmounts.
_session_open = False


def mount(ops: pyfuse3.Operations, mountpoint: str, options: set[str] = MOUNT_OPTIONS,
          background: int = 0) -> None:  # fmt: skip
    """Mount `ops` at `mountpoint` (RuntimeError if the kernel refuses); the output daemon
    (output/fs.py) mounts its own operations with its own options. `background`: how many
    READs the kernel may have outstanding in the background (its readahead; 0: its default)."""
    global _session_open
    if hasattr(pyfuse3, "set_background"):
        pyfuse3.set_background(background)
    pyfuse3.init(ops, mountpoint, set(pyfuse3.default_options) | options)
    _session_open = True


async def serve() -> None:
    """Answer kernel requests until unmounted or `terminate` is called."""
    await pyfuse3.main()


def terminate() -> None:
    """Make `serve` return (at once if it has not started); nothing once unmounted."""
    if _session_open:
        pyfuse3.terminate()


def unmount() -> None:
    """Unmount and free the session (idempotent)."""
    global _session_open
    if _session_open:
        _session_open = False
        pyfuse3.close(unmount=True)


def push_to_kernel(entry: int, offset: int, data: bytes) -> bool:
    """Store bytes of a file at `offset` in the kernel's page cache (planned epochs); False
    when the kernel does not know the file's inode (never looked up, or forgotten) or
    refuses, and once the session is closed."""
    if not _session_open:
        return False
    try:
        pyfuse3.notify_store(entry + ROOT, offset, data)
        return True
    except OSError:
        return False


def _install_hook(capsule: Any) -> None:
    """Register the native read pool's hook with pyfuse3 (read handlers hand it jobs); None
    removes it."""
    pyfuse3.set_read_hook(capsule)  # type: ignore[attr-defined]


# How the native read pool gets READs (fanfs/node/pool.py); None when this pyfuse3 cannot.
INSTALL_HOOK = _install_hook if READ_HOOK else None


def _install_receiver(capsule: Any, fd: int) -> None:
    """Let the front's threads take requests from the FUSE device (capsule, and the fd the
    session loop waits on for the ones they forward); None: the loop reads the device."""
    pyfuse3.set_receiver(capsule, fd)  # type: ignore[attr-defined]


def _session_fd() -> int:
    return int(pyfuse3.session_fileno()) if _session_open else -1  # type: ignore[attr-defined]


# How the front (fanfs/csrc/front.c) takes requests: (install the receiver, the session's fd);
# None when this pyfuse3 has no receiver hook.
RECEIVER = (_install_receiver, _session_fd) if hasattr(pyfuse3, "set_receiver") else None
# What the front answers in attributes, as `_attrs` does: (blksize, cache timeout in seconds).
FRONT_ATTRS = (BLKSIZE, int(CACHE_TIMEOUT_S))


def forget_pages(entry: int) -> bool:
    """Drop the kernel's cached pages of a file (cold measurements); False when the kernel
    does not know its inode, or the session is closed. Call from a worker thread: the kernel
    may wait for READs in flight, which the event loop may be the one to answer."""
    if not _session_open:
        return False
    try:
        pyfuse3.invalidate_inode(entry + ROOT, attr_only=False)
        return True
    except OSError:
        return False
