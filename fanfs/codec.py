"""Per-file codecs: how a file's bytes are stored in a partition and turned back.

Concurrency: zstd (de)compressor objects are not thread-safe (a shared decompressor corrupted
data in a probe, see ENVIRONMENT.md), so each thread gets its own through `threading.local`.
"""

from __future__ import annotations

import threading
import zlib

import zstandard

from fanfs.catalog import CODEC_RAW, CODEC_ZSTD
from fanfs.errors import CorruptFile

_local = threading.local()


def parse_compress(spec: str) -> tuple[int, int]:
    """`none` | `zstd` | `zstd:LEVEL` -> (codec, level). Raises ValueError on anything else."""
    if spec == "none":
        return CODEC_RAW, 0
    name, _, level = spec.partition(":")
    if name != "zstd":
        raise ValueError(f"unknown compression {spec!r} (use none, zstd or zstd:LEVEL)")
    if not level:
        return CODEC_ZSTD, 3
    if not level.lstrip("-").isdigit() or not -7 <= int(level) <= 22:
        raise ValueError(f"zstd level must be an integer from -7 to 22, not {level!r}")
    return CODEC_ZSTD, int(level)


def encode(data: bytes, codec: int, level: int) -> tuple[int, bytes]:
    """Store `data` with `codec`, or raw when that does not make it smaller."""
    if codec == CODEC_ZSTD and data:
        compressors = _local.__dict__.setdefault("compressors", {})
        cctx = compressors.get(level)
        if cctx is None:
            # The frame's own content checksum lets decompression catch a bad codec path too.
            cctx = compressors[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
        packed: bytes = cctx.compress(data)
        if len(packed) < len(data):
            return CODEC_ZSTD, packed
    return CODEC_RAW, data


def decode(stored: bytes, codec: int, size: int, crc: int) -> bytes:
    """Check `stored` against its CRC-32, then decode it to exactly `size` bytes."""
    if zlib.crc32(stored) != crc:
        raise CorruptFile("checksum mismatch")
    if codec == CODEC_RAW:
        return stored
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        data: bytes = dctx.decompress(stored, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptFile(f"zstd: {e}") from None
    if len(data) != size:
        raise CorruptFile(f"decoded {len(data)} bytes, expected {size}")
    return data
