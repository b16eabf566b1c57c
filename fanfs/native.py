"""The native read pool's contract on the Python side, in one place.

fanfs's pyfuse3 patch (tools/install_pyfuse3.py builds it from tools/pyfuse3_patch/) adds to
pyfuse3: a read handler may return a `NativeJob` instead of bytes, and C threads then read the
whole file, check its CRC-32 and answer the kernel without the GIL or the event loop;
`native_read_start(threads, error_fd)` and `native_read_stop()` run the pool (reached through
fuse_ops, the one module importing pyfuse3); a failure answers EIO and posts an `ERROR_RECORD`
on `error_fd`, which `NativePool.errors` turns into the reader's bad-file registry.

`PATCH_LEVEL` is the one definition of the patch level: install_pyfuse3 writes it into the build
(`pyfuse3.FANFS_PATCH`) and rebuilds an older one; fuse_ops compares it with `POOL_LEVEL`.

Concurrency: `start` and `stop` run in the main thread around the trio run (stop while the
FUSE session still exists, so queued jobs are answered); `errors` is a trio task.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

PATCH_LEVEL = 5  # pyfuse3.FANFS_PATCH of the build tools/install_pyfuse3.py makes
POOL_LEVEL = 2  # the first level with the native read pool
THREADS = 4  # pool threads: concurrent disk reads of small files on a 2-core node
# The pool's failure record (native byte order): entry, errno, padding.
ERROR_RECORD = struct.Struct("=qii")
# (fd, offset, length, crc, entry, skip, count): a whole file for the pool to read, check
# against `crc` and answer with bytes [skip, skip + count) of it.
NativeJob = tuple[int, int, int, int, int, int, int]


class NativePool:
    def __init__(
        self,
        start: Callable[[int, int], str | None],
        stop: Callable[[], None],
        failed: Callable[[int, int], None],
    ):
        self._start, self._stop, self._failed = start, stop, failed
        self._rfd = self._wfd = -1
        self.running = False
        self.crc32: str | None = None  # the library the pool checks CRCs with

    def start(self, stack: contextlib.ExitStack) -> bool:
        """Start the pool; False (and a warning) if this build cannot."""
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        stack.callback(os.close, rfd)  # runs once trio is done with it
        try:
            crc = self._start(THREADS, wfd)
        except OSError as e:
            os.close(wfd)
            log.warning("native read pool unavailable, reading in Python: %s", e)
            return False
        self._rfd, self._wfd = rfd, wfd  # wfd closes in stop, once the pool has stopped
        self.crc32 = crc if isinstance(crc, str) else "zlib"  # older builds: None
        if self.crc32 != "isa-l":
            log.info("native read pool: CRC-32 by zlib (install libisal2 for a faster one)")
        self.running = True
        return True

    async def errors(self) -> None:
        """Hand every failure record to `failed(entry, errno)` until the pool stops."""
        while True:
            await trio.lowlevel.wait_readable(self._rfd)
            try:
                records = os.read(self._rfd, ERROR_RECORD.size * 256)
            except BlockingIOError:
                continue
            if not records:
                return  # the pool has stopped and its end is closed
            for entry, err, _ in ERROR_RECORD.iter_unpack(records):
                try:
                    self._failed(entry, err)
                except Exception:  # a bad record must not end the daemon's task group
                    log.exception("native read pool reported entry %d, errno %d", entry, err)

    def stop(self) -> None:
        """Answer what is queued, stop the threads, close the record pipe's write end."""
        if self.running:
            self.running = False
            self._stop()
            os.close(self._wfd)


def failure_reason(err: int) -> str:
    """What a failure record's errno means (EBADMSG: the bytes did not match their CRC)."""
    return "checksum mismatch" if err == errno.EBADMSG else os.strerror(err)
