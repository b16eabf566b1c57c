"""The native read pool's contract on the Python side, in one place.

fanfs's pyfuse3 patch (tools/install_pyfuse3.py builds it from tools/pyfuse3_patch/) adds to
pyfuse3: a read handler may return a `NativeJob` instead of bytes, and C threads then read the
stored pieces (a whole file, or the frames of a framed file the request touches), check their
CRC-32, decode them (zstd with the image's dictionaries, and every array filter, by libzstd and
C code that mirrors fanfs/filters.py) and answer the kernel without the GIL or the event loop;
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
from collections.abc import Callable, Sequence

import trio

log = logging.getLogger(__name__)

PATCH_LEVEL = 6  # pyfuse3.FANFS_PATCH of the build tools/install_pyfuse3.py makes
POOL_LEVEL = 6  # the first level whose pool takes jobs as `job` below and decodes
# Pool threads: at least 4 (concurrent disk reads of small files, even on a 2-core node), and
# one per core up to 32 on bigger nodes, where decoding compressed files is what they do most.
THREADS = max(4, min(32, os.cpu_count() or 4))
MAX_PIECES = 4  # stored pieces (frames) one job may span
# Files stored whole up to this size are answered by the pool also when a READ asks for a part
# (it keeps the decoded file in its frame cache, 64 MiB in all, for the other parts).
PARTS_LIMIT = 4 << 20
# The pool's failure record (native byte order): entry, errno, padding.
ERROR_RECORD = struct.Struct("=qii")
# What a piece's stored bytes are (fanfs_read_pool.h's FANFS_KIND_*).
KIND_RAW = 0  # the bytes themselves
KIND_ZSTD = 1  # one zstd frame (its header names its dictionary, if any)
KIND_FILTERED = 2  # a filter id byte, then one zstd frame of that filter's output
KIND_FILTER = 16  # 16 + filter id: one zstd frame of that filter's output
# (fd, entry, skip, count, then per stored piece: offset, length, crc, kind, size, cache): the
# pool reads each piece's `length` stored bytes at `offset` in `fd`, checks them against `crc`,
# decodes them to `size` bytes (keeping frames in its frame cache when `cache`), and answers
# with bytes [skip, skip + count) of the pieces' decoded bytes, back to back.
NativeJob = tuple[int, ...]


def job(fd: int, entry: int, skip: int, count: int, pieces: Sequence[tuple[int, ...]]) -> NativeJob:
    """A NativeJob from its pieces, each (offset, length, crc, kind, size, cache)."""
    return (fd, entry, skip, count, *(x for piece in pieces for x in piece))


class NativePool:
    def __init__(
        self,
        start: Callable[[int, int], str | None],
        stop: Callable[[], None],
        failed: Callable[[int, int], None],
        dictionaries: Callable[[Sequence[bytes]], bool],
    ):
        self._start, self._stop, self._failed = start, stop, failed
        self._dictionaries = dictionaries
        self._rfd = self._wfd = -1
        self.running = False
        self.crc32: str | None = None  # the library the pool checks CRCs with
        self.decodes = False  # whether it decodes zstd (libzstd found, dictionaries taken)

    def start(self, stack: contextlib.ExitStack, dicts: Sequence[bytes] = ()) -> bool:
        """Start the pool with the image's dictionaries; False (and a warning) if this build
        cannot. Without libzstd it runs, but for raw pieces only (`decodes` False)."""
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
        try:
            self.decodes = self._dictionaries(dicts)
        except OSError as e:
            log.warning("native read pool cannot take the image's dictionaries: %s", e)
        if not self.decodes:
            log.info("native read pool: compressed files decoded in Python (no libzstd1)")
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
    """What a failure record's errno means (EBADMSG: the bytes did not match their CRC;
    EILSEQ: they did, but do not decode to the catalog's size)."""
    if err == errno.EBADMSG:
        return "checksum mismatch"
    if err == errno.EILSEQ:
        return "stored bytes do not decode (corrupt image)"
    return os.strerror(err)
