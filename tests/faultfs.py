"""A disk that fails on demand: a read-only FUSE passthrough of a directory whose reads of one
file's byte range fail with a real errno, for the fault-injection tests.

    python faultfs.py SRC MOUNTPOINT CONTROL

CONTROL is a JSON file read at every read: {"name": "part-00001.pack", "lo": 0, "hi": 4096,
"errno": 5}, or {} for no fault. Every read goes to this process (direct_io): the kernel keeps
no page cache of it, so a fault armed later is seen by the next read. The daemon under test
reads the image through a real kernel mount and gets a real EIO from pread/sendfile.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from typing import Any

import pyfuse3
import trio


class FaultFS(pyfuse3.Operations):
    def __init__(self, src: str, control: str):
        super().__init__()
        self.control = control
        self.paths = {pyfuse3.ROOT_INODE: src}
        self.inodes = {src: pyfuse3.ROOT_INODE}

    def _attrs(self, path: str) -> pyfuse3.EntryAttributes:
        st = os.lstat(path)
        a = pyfuse3.EntryAttributes()
        a.st_ino = self.inodes.setdefault(path, len(self.inodes) + pyfuse3.ROOT_INODE)
        self.paths[a.st_ino] = path
        for key in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size"):
            setattr(a, key, getattr(st, key))
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = st.st_mtime_ns
        return a

    async def lookup(self, parent: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        path = os.path.join(self.paths[parent], os.fsdecode(name))
        if not os.path.lexists(path):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(path)

    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._attrs(self.paths[inode])

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    async def readdir(self, fh: int, start: int, token: Any) -> None:
        names = sorted(os.listdir(self.paths[fh]))
        for i, name in enumerate(names[start:], start):
            attrs = self._attrs(os.path.join(self.paths[fh], name))
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attrs, i + 1):
                return

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR) or not stat.S_ISREG(
            os.stat(self.paths[inode]).st_mode
        ):
            raise pyfuse3.FUSEError(errno.EACCES)
        return pyfuse3.FileInfo(fh=os.open(self.paths[inode], os.O_RDONLY), direct_io=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        try:
            with open(self.control) as f:
                fault = json.load(f)
        except (OSError, ValueError):
            fault = {}
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fh}"))
        if fault and name == fault["name"] and off < fault["hi"] and off + size > fault["lo"]:
            raise pyfuse3.FUSEError(int(fault["errno"]))
        return os.pread(fh, size, off)

    async def release(self, fh: int) -> None:
        os.close(fh)


def main() -> None:
    src, mountpoint, control = sys.argv[1:4]
    pyfuse3.init(FaultFS(os.path.abspath(src), control), mountpoint, {"fsname=faultfs", "ro"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
