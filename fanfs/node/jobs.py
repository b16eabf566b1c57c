"""The native read pool's jobs: the record a READ hands the C (fanfs/csrc/pool.c) instead of
bytes, built from the catalog. Pure functions of the catalog and a frame table: no I/O, no
state, safe in any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fanfs.image import catalog as cat
from fanfs.image import codec, filters
from fanfs.native import lib

MAX_PIECES = lib.MAX_PIECES  # stored pieces (frames) one job may span
JOB_FIELDS = lib.JOB_FIELDS  # a job's header; then 6 numbers per piece
INODE_BASE = 1  # inode = entry + INODE_BASE (pyfuse3.ROOT_INODE; fuse_ops checks it)
KIND_RAW, KIND_ZSTD, KIND_FILTERED, KIND_FILTER = (
    lib.KIND_RAW, lib.KIND_ZSTD, lib.KIND_FILTERED, lib.KIND_FILTER)  # fmt: skip
# (fd, dfd, entry, inode, base, skip, count, flags), then per stored piece (offset, length,
# crc, kind, size, cache): the pool reads each piece's `length` stored bytes at `offset` (with
# O_DIRECT through `dfd` when it is not -1 and the page cache does not hold them), checks them
# against `crc`, decodes them to `size` bytes (keeping them in its cache when `cache`), and
# answers with bytes [skip, skip + count) of the pieces' decoded bytes, back to back; the
# first piece starts at `base` in the file. Flags: lib.JOB_PUSH.
NativeJob = tuple[int, ...]


def job(fd: int, dfd: int, entry: int, base: int, skip: int, count: int, flags: int,
        pieces: Sequence[tuple[int, ...]]) -> NativeJob:  # fmt: skip
    """A NativeJob from its pieces, each (offset, length, crc, kind, size, cache)."""
    return (fd, dfd, entry, entry + INODE_BASE, base, skip, count, flags,
            *(x for piece in pieces for x in piece))  # fmt: skip


def piece_kind(codec_id: int) -> int:
    """The kind of a file's stored bytes compressed whole (not framed)."""
    if codec_id == cat.CODEC_RAW:
        return KIND_RAW
    if codec_id in (cat.CODEC_ZSTD, cat.CODEC_ZSTD_DICT):
        return KIND_ZSTD
    if codec_id == cat.CODEC_ZSTD_DELTA4:
        return KIND_FILTER + filters.DELTA4
    return KIND_FILTERED


def whole_piece(c: cat.Catalog, entry: int, cache: int) -> tuple[int, ...]:
    """A file stored whole as a job's piece (kept in the pool's cache of pieces if `cache`)."""
    return (int(c.data_off[entry]), int(c.stored_len[entry]), int(c.crc[entry]),
            piece_kind(int(c.codec[entry])), int(c.size[entry]), cache)  # fmt: skip


def frame_kind(table: codec.FrameTable, i: int) -> int:
    """The kind of frame i of a framed file."""
    fid = int(table.filters[i])
    if fid:
        return KIND_FILTER + fid
    return KIND_RAW if table.stored(i)[1] == table.decoded_len(i) else KIND_ZSTD


def frame_piece(c: cat.Catalog, entry: int, table: codec.FrameTable, i: int) -> tuple[int, ...]:
    """Frame i of a framed file as a job's piece (kept in the pool's cache of pieces)."""
    off, length = table.stored(i)
    return (int(c.data_off[entry]) + off, length, int(table.crcs[i]), frame_kind(table, i),
            table.decoded_len(i), 1)  # fmt: skip


# Codecs of files stored whole, which the fast path answers (framed files go to Python,
# which keeps their frame tables).
WHOLE_CODECS = (cat.CODEC_RAW, cat.CODEC_ZSTD, cat.CODEC_ZSTD_DICT, cat.CODEC_ZSTD_DELTA4,
                cat.CODEC_ZSTD_FILTERED)  # fmt: skip


def fast_kinds(c: cat.Catalog, decodes: bool) -> np.ndarray:
    """Per entry, the piece kind the fast path reads it as, or lib.FAST_NO: a non-empty file
    stored whole, of at most PIECE_MAX bytes stored and decoded (compressed ones only when
    the pool decodes)."""
    kind = np.full(c.n_entries, lib.FAST_NO, dtype=np.uint8)
    files = c.is_file & (c.size > 0) & (c.size <= lib.PIECE_MAX) & (c.stored_len <= lib.PIECE_MAX)
    for codec_id in WHOLE_CODECS if decodes else (cat.CODEC_RAW,):
        kind[files & (c.codec == codec_id)] = piece_kind(codec_id)
    return kind
