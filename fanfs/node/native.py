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

Everything the rest of the daemon knows of the pool is here: `NativePool` says whether it runs
and decodes (the Reader asks it), builds the jobs from the catalog (a whole file, the frames a
READ touches), queues read-aheads, and turns failure records into `BadFiles`. The pyfuse3 calls
themselves come in as `Hooks` from fuse_ops, the one module importing pyfuse3.

Concurrency: `start` and `stop` run in the main thread around the trio run (stop while the
FUSE session still exists, so queued jobs are answered); `errors` is a trio task; the rest
runs in the trio thread (`running` and `decodes` are plain reads, safe anywhere).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from fanfs import catalog as cat
from fanfs import codec, filters
from fanfs.errors import CorruptFile

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


@dataclass(frozen=True)
class Hooks:
    """The pyfuse3 calls that run the pool (fanfs/node/fuse_ops.py provides them)."""

    start: Callable[[int, int], str | None]  # (threads, error fd) -> its CRC-32 library
    stop: Callable[[], None]
    dictionaries: Callable[[Sequence[bytes]], bool]  # False: it cannot decode (no libzstd)
    read_ahead: Callable[[NativeJob], bool]  # queued?
    frame_stats: Callable[[], tuple[int, int]]  # (hits, misses) of its cache of pieces


def piece_kind(codec_id: int) -> int:
    """The kind of a file's stored bytes compressed whole (not framed)."""
    if codec_id == cat.CODEC_RAW:
        return KIND_RAW
    if codec_id in (cat.CODEC_ZSTD, cat.CODEC_ZSTD_DICT):
        return KIND_ZSTD
    if codec_id == cat.CODEC_ZSTD_DELTA4:
        return KIND_FILTER + filters.DELTA4
    return KIND_FILTERED


def frame_piece(c: cat.Catalog, entry: int, table: codec.FrameTable, i: int) -> tuple[int, ...]:
    """Frame i of a framed file as a job's piece (kept in the pool's cache of pieces)."""
    off, length = table.stored(i)
    n, fid = table.decoded_len(i), int(table.filters[i])
    kind = KIND_FILTER + fid if fid else (KIND_RAW if length == n else KIND_ZSTD)
    return (int(c.data_off[entry]) + off, length, int(table.crcs[i]), kind, n, 1)


class NativePool:
    def __init__(self, catalog: cat.Catalog, hooks: Hooks | None,
                 failed: Callable[[int, BaseException], None], decode: bool = True):  # fmt: skip
        """`hooks`: None where pyfuse3 has no pool (the Reader then reads in Python);
        `failed(entry, error)`: a file the pool found bad (the bad-file registry's `mark`);
        `decode`: False keeps compressed files in Python (FANFS_NATIVE_DECODE=0)."""
        self.catalog = catalog
        self.hooks = hooks
        self.failed = failed
        self._decode = decode
        self._rfd = self._wfd = -1
        self.running = False
        self.crc32: str | None = None  # the library the pool checks CRCs with
        self.can_decode = False  # libzstd found and the image's dictionaries taken
        self.jobs = 0  # READs answered by the pool

    @property
    def decodes(self) -> bool:
        """Whether compressed pieces go to the pool now."""
        return self.running and self.can_decode and self._decode

    def start(self, stack: contextlib.ExitStack) -> bool:
        """Start the pool with the image's dictionaries; False (and a warning) if this build
        cannot. Without libzstd it runs, but for raw pieces only."""
        if self.hooks is None:
            return False
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        stack.callback(os.close, rfd)  # runs once trio is done with it
        try:
            crc = self.hooks.start(THREADS, wfd)
        except OSError as e:
            os.close(wfd)
            log.warning("native read pool unavailable, reading in Python: %s", e)
            return False
        self._rfd, self._wfd = rfd, wfd  # wfd closes in stop, once the pool has stopped
        self.crc32 = crc if isinstance(crc, str) else "zlib"  # older builds: None
        if self.crc32 != "isa-l":
            log.info("native read pool: CRC-32 by zlib (install libisal2 for a faster one)")
        try:
            self.can_decode = self.hooks.dictionaries(self.catalog.dicts)
        except OSError as e:
            log.warning("native read pool cannot take the image's dictionaries: %s", e)
        if not self.can_decode:
            log.info("native read pool: compressed files decoded in Python (no libzstd1)")
        self.running = True
        stack.callback(self.stop)
        return True

    async def errors(self) -> None:
        """Mark every file the pool reports as bad, until the pool stops."""
        while True:
            await trio.lowlevel.wait_readable(self._rfd)
            try:
                records = os.read(self._rfd, ERROR_RECORD.size * 256)
            except BlockingIOError:
                continue
            if not records:
                return  # the pool has stopped and its end is closed
            for entry, err, _ in ERROR_RECORD.iter_unpack(records):
                if 0 <= entry < self.catalog.n_entries:
                    self.failed(entry, CorruptFile(failure_reason(err)))
                else:  # a record the pool would never write: not worth ending the daemon
                    log.error("native read pool reported entry %d, errno %d", entry, err)

    def stop(self) -> None:
        """Answer what is queued, stop the threads, close the record pipe's write end."""
        if self.running:
            self.running = False
            assert self.hooks is not None
            self.hooks.stop()
            os.close(self._wfd)

    def frame_stats(self) -> tuple[int, int]:
        return self.hooks.frame_stats() if self.hooks is not None else (0, 0)

    # -- jobs --------------------------------------------------------------------------------

    def whole(self, fd: int, entry: int, offset: int, size: int) -> NativeJob:
        """A job answering [offset, offset + size) of a file stored whole: the pool reads,
        checks and decodes all of it, and keeps it in its cache of pieces when the request is
        a part (the rest is likely asked next)."""
        c = self.catalog
        length = int(c.size[entry])
        whole = offset == 0 and size == length
        piece = (int(c.data_off[entry]), int(c.stored_len[entry]), int(c.crc[entry]),
                 piece_kind(int(c.codec[entry])), length, 0 if whole else 1)  # fmt: skip
        self.jobs += 1
        return job(fd, entry, offset, size, [piece])

    def frames(self, fd: int, entry: int, table: codec.FrameTable, offset: int, size: int,
               ahead: range) -> NativeJob | None:  # fmt: skip
        """A job answering [offset, offset + size) of a framed file from the frames it
        touches (None: more than MAX_PIECES), after queueing read-aheads of the frames in
        `ahead` (one job each, so that idle threads take them in parallel)."""
        fs = table.frame_size
        first, last = offset // fs, (offset + size - 1) // fs
        if last - first >= MAX_PIECES:
            return None
        if self.hooks is not None:
            for i in ahead:
                self.hooks.read_ahead(job(fd, entry, 0, 0, [frame_piece(self.catalog, entry,
                                                                        table, i)]))  # fmt: skip
        pieces = [frame_piece(self.catalog, entry, table, i) for i in range(first, last + 1)]
        self.jobs += 1
        return job(fd, entry, offset - first * fs, size, pieces)


def failure_reason(err: int) -> str:
    """What a failure record's errno means (EBADMSG: the bytes did not match their CRC;
    EILSEQ: they did, but do not decode to the catalog's size)."""
    if err == errno.EBADMSG:
        return "checksum mismatch"
    if err == errno.EILSEQ:
        return "stored bytes do not decode (corrupt image)"
    return os.strerror(err)
