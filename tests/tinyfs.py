"""A file system of five files on pyfuse3 alone (not fanfs), to test fanfs's pyfuse3 patch.

    python tests/tinyfs.py BACKING MOUNTPOINT [--receiver]

- `whoami`: its read answers the file handle it was given (no_open: the patch's inode);
- `plain`: bytes from the handler, as stock pyfuse3 answers;
- `hooked`: the handler returns a job tuple (fanfs/node/pool.py's layout) for BACKING's bytes,
  which the read hook registered with `pyfuse3.set_read_hook` answers from C threads;
- `broken`: the handler returns a tuple no hook takes (the reader must get EIO, not a hang);
- `stats`: with --receiver, the receiver's counters as JSON.

With --receiver, requests come to the session loop through `pyfuse3.set_receiver`: fanfs's
front (fanfs/csrc/front.c) takes them from the device and, given no catalog to answer from,
forwards every one. Runs until unmounted; prints "ready" once mounted.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import zlib

import numpy as np
import pyfuse3
import trio

from fanfs.native import lib

NAMES = [b"whoami", b"plain", b"hooked", b"broken", b"stats"]
PLAIN = bytes(range(256)) * 1000
FRONT: lib.Front | None = None  # with --receiver: the front (its counters are the stats file)


class Tiny(pyfuse3.Operations):
    def __init__(self, backing: str):
        super().__init__()
        self.fd = os.open(backing, os.O_RDONLY)
        self.data = os.pread(self.fd, 1 << 30, 0)
        self.crc = zlib.crc32(self.data)

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode = stat.S_IFDIR | 0o755
            return a
        a.st_mode = stat.S_IFREG | 0o644
        sizes = {"plain": len(PLAIN), "hooked": len(self.data), "broken": 10}
        a.st_size = sizes.get(NAMES[inode - 2].decode(), 4096)
        return a

    async def lookup(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:  # fmt: skip
        if parent != pyfuse3.ROOT_INODE or name not in NAMES:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(NAMES.index(name) + 2)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        raise pyfuse3.FUSEError(errno.ENOSYS)  # no_open: READs then come with handle 0

    async def read(self, fh: int, off: int, size: int) -> object:  # type: ignore[override]
        name = NAMES[fh - 2] if 2 <= fh < 2 + len(NAMES) else b"?"
        if name == b"whoami":
            return str(fh).encode().ljust(4096)[off : off + size]
        if name == b"plain":
            return PLAIN[off : off + size]
        if name == b"hooked":
            size = max(0, min(size, len(self.data) - off))
            return (self.fd, -1, fh - 2, fh, 0, off, size, 0,
                    0, len(self.data), self.crc, lib.KIND_RAW, len(self.data), 1)  # fmt: skip
        if name == b"broken":
            return (1, 2, 3)
        stats = json.dumps(lib.front_stats(FRONT)).encode()
        return stats.ljust(4096)[off : off + size]


def main() -> None:
    global FRONT
    backing, mountpoint = sys.argv[1], sys.argv[2]
    ops = Tiny(backing)
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    pyfuse3.init(ops, mountpoint, {"fsname=tinyfs", "ro"})
    lib.pool_start(2, wfd)
    pyfuse3.set_read_hook(lib.read_hook())  # type: ignore[attr-defined]
    receiver = "--receiver" in sys.argv[3:]
    if receiver:  # a one-entry catalog and the fast path off: the front forwards everything
        one = {name: np.zeros(1, dtype=dtype.replace("=", "<")) for name, dtype in
               lib.META_COLUMNS.items()}  # fmt: skip
        meta = lib.Meta(one, b"", np.zeros(1, dtype=np.uint8), os.getuid(), os.getgid(), 4096, 1)
        front = FRONT = lib.Front(meta)
        ready = front.start(pyfuse3.session_fileno(), 2, 0)  # type: ignore[attr-defined]
        pyfuse3.set_receiver(front.receiver(), ready)  # type: ignore[attr-defined]
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        if receiver:
            pyfuse3.set_receiver(None)  # type: ignore[attr-defined]
            front.stop()
        lib.pool_stop()
        pyfuse3.set_read_hook(None)  # type: ignore[attr-defined]
        pyfuse3.close(unmount=True)
        if receiver:
            front.close()
        os.close(wfd)
        os.close(rfd)


if __name__ == "__main__":
    main()
