"""The prepared image's on-disk format, as constants: the catalog's header and columns, codec
ids, the frame table, limits, and where each column lies in the body (docs/format.md defines
the bytes). Pure data: the catalog (fanfs/image/catalog.py) and its checks
(fanfs/image/catalog_check.py) read it; `fanfs.image.catalog` re-exports every name, so
`catalog.CODEC_RAW` reads as before.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

MAGIC = b"FANFSCAT"
VERSION = 4  # what prepare writes
# What a reader accepts, and the columns each older version lacks: a reader derives `blocks`
# from the size as fanfs did before version 3, and does without `part_sha256` (version 4: a
# kept partition is then keyed by its files' CRCs, fanfs/node/keep.py).
READ_VERSIONS = (2, 3, 4)
MISSING = {2: ("blocks", "part_sha256"), 3: ("part_sha256",), 4: ()}
CATALOG_NAME = "catalog.fanfs"
NO_PARTITION = 0xFFFFFFFF

# Codec ids stored per file. New codecs get new ids; a reader refuses ids it does not know.
CODEC_RAW = 0
CODEC_ZSTD = 1  # one zstd frame
CODEC_ZSTD_DICT = 2  # one zstd frame made with the catalog dictionary its header names
CODEC_FRAMED = 3  # independent frames of `frame_size` bytes each, then a table of them
CODEC_ZSTD_DELTA4 = 4  # one zstd frame of the delta4 filter's output (docs/format.md)
CODEC_ZSTD_FILTERED = (
    5  # a filter id byte (fanfs/image/filters.py), then one zstd frame of its output
)
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd-dict",
               CODEC_FRAMED: "framed", CODEC_ZSTD_DELTA4: "zstd-delta4",
               CODEC_ZSTD_FILTERED: "zstd-filtered"}  # fmt: skip
# A framed file's table: per frame, (stored length, CRC-32 of the stored frame), u32 each.
# The length's low 28 bits are the stored length, its top 4 bits the filter the frame went
# through before zstd (0: none; delta4's id 8 is the top bit alone, as format 2 began).
FRAME_ENTRY = 8
FRAME_FILTER_SHIFT = 28
FRAME_LEN_MASK = (1 << FRAME_FILTER_SHIFT) - 1

S_IFMT = 0o170000  # the file-type bits of st_mode (stat.S_IFMT is a function)
NAME_MAX = 255  # bytes in one name, as in every Linux file system (FUSE refuses longer ones)
# A file compressed whole is decoded whole in memory. prepare frames every compressed file over
# 4 MiB, so a catalog that claims a larger whole-compressed file is hostile.
WHOLE_DECODE_MAX = 4 << 20
# The decoded bytes per frame of a framed file: prepare writes this one size. Another (up to
# 256 MiB would fit the table's 28 bits) could make every decode cost a GiB: refused.
FRAME_SIZE = 1 << 20
# st_blocks counts 512-byte units whatever the file system's block size (stat(2)).
BLOCK_UNIT = 512
# The most `blocks` may say: 512 times it still fits a signed 64-bit byte count, which is what
# stat's users (du, cp, pyfuse3's blkcnt_t) turn it into. Real sources stay far below; not tied
# to the size, because a source may hold blocks past its end (fallocate --keep-size) and
# prepare reports what the source had.
BLOCKS_MAX = (1 << 63) // BLOCK_UNIT - 1
_WORD = 8  # bytes of a name compared at a time when checking the order of names
_CHUNK = 1 << 18  # name pairs compared per numpy pass (bounds the check's memory)

# Partition flags (bit set).
PART_BROADCAST = 1

# magic, version, header_crc, n_entries, n_partitions, flags, strings_len, meta_len, body_len,
# body_sha256, n_dicts, frame_size. header_crc is the CRC-32 of the header with it zeroed.
HEADER = struct.Struct("<8sIIQIIQQQ32sII")

# Column order and types are part of the format (docs/format.md). Entry columns first.
ENTRY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("parent", "<u4"),
    ("mode", "<u4"),
    ("mtime_ns", "<i8"),
    ("size", "<u8"),
    ("name_off", "<u8"),
    ("name_len", "<u4"),
    ("child_start", "<u4"),
    ("child_count", "<u4"),
    ("part", "<u4"),
    ("data_off", "<u8"),  # files: offset in the partition; symlinks: offset in the strings
    ("stored_len", "<u8"),
    ("crc", "<u4"),  # CRC-32 of the stored bytes
    ("codec", "<u1"),
    ("blocks", "<u8"),  # st_blocks of the source: 512-byte units allocated (version 3)
)
PARTITION_COLUMNS: tuple[tuple[str, str], ...] = (
    ("part_size", "<u8"),
    ("part_files", "<u8"),
    ("part_flags", "<u4"),
    ("part_sha256", "V32"),  # SHA-256 of the partition file's bytes (version 4)
)
DICT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("dict_off", "<u8"),  # offset of dictionary i (zstd dict id i + 1) in the string table
    ("dict_len", "<u8"),
)
ALIGN = 8  # every column starts 8-byte aligned so np.frombuffer views need no copy


def partition_name(part: int) -> str:
    return f"part-{part:05d}.pack"


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def n_frames(size: Any, frame_size: int) -> Any:
    """Frames of a framed file of `size` bytes (works on numpy columns too; never wraps
    around, even for a size near 2**64)."""
    return size // frame_size + (size % frame_size != 0)


def blocks_of_size(size: Any) -> Any:
    """st_blocks as fanfs reported it before images carried it (version 2): the size rounded
    up to 512-byte units (works on numpy columns too; never wraps around near 2**64)."""
    return size // BLOCK_UNIT + (size % BLOCK_UNIT != 0)


def _body_layout(
    n_entries: int, n_partitions: int, n_dicts: int, version: int = VERSION
) -> list[tuple[str, str, int, int]]:
    """(name, dtype, offset, count) of each column within the body of a catalog of `version`
    (one of READ_VERSIONS)."""
    layout = []
    pos = 0
    sections = ((ENTRY_COLUMNS, n_entries), (PARTITION_COLUMNS, n_partitions),
                (DICT_COLUMNS, n_dicts))  # fmt: skip
    for columns, count in sections:
        for name, dtype in columns:
            if name in MISSING[version]:
                continue
            layout.append((name, dtype, pos, count))
            pos += _padded(np.dtype(dtype).itemsize * count)
    layout.append(("strings", "u1", pos, -1))
    return layout
