"""Per-file codecs: how a file's bytes are stored in a partition and turned back.

Policies (`fanfs prepare --compress`):
- `none`: every file raw.
- `zstd[:LEVEL]`: every file compressed when that makes it smaller at all.
- `auto[:LEVEL]` (the default): compress what pays, store the rest raw. Formats that are
  compressed already (JPEG, PNG, GIF, gzip, zstd, xz, bzip2, deflated zip/npz) are recognised
  by their first bytes and stored raw without trying; anything else keeps its compressed form
  only if that saves at least 1/8, since a smaller saving is not worth decompressing on every
  read.
Under zstd and auto, files up to DICT_MAX_FILE use the dictionary trained for files like them
(when prepare trained one), and files above FRAMED_MIN are cut into independent frames of the
image's frame size, so a read anywhere in a large file decodes only the frames it touches. A
frame is stored raw when compressing it does not pay, which makes a frame's stored length equal
to its decoded length exactly when it is raw (a compressed frame is always strictly smaller).
Where zstd alone does not halve a file or frame of whole 32-bit words, the array filters
(fanfs/image/filters.py: shuffle, delta, decimal) are tried on a sample and the best one on the
whole, kept when it beats plain zstd (smooth float32 fields: 1.25 plain, 2.5 with delta4; float32
values rounded to two decimals: 1.56 plain, 3.1 with decimal4; docs/performance.md).

Decoding is fanfs's C extension's (fanfs/native.py): the same code the native read pool runs,
with the GIL released, so every path (local and remote reads, the planner, `fanfs verify`)
decodes alike and in parallel. Where libzstd is missing it falls back to the zstandard package
and fanfs/image/filters.py, which stay the reference the C is tested against.

Concurrency: zstd (de)compressor objects are not thread-safe (a shared decompressor corrupted
data in a probe, see docs/environment.md), so each thread gets its own through `threading.local`.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from fanfs import native
from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.image import filters
from fanfs.image.checksum import crc32

FRAME_SIZE = cat.FRAME_SIZE  # decoded bytes per frame of a framed file (the catalog's rule)
FRAMED_MIN = 4 * FRAME_SIZE  # files larger than this are framed (zstd and auto)
DICT_MAX_FILE = 64 << 10  # files up to this use their group's dictionary, if there is one
AUTO_MIN_SAVING = 8  # auto keeps compression only if stored <= size - size / 8
# Array filters are tried on blocks of at least FILTER_MIN bytes that zstd alone shrinks less
# than FILTER_MAX_RATIO times (float64 decimals: zstd 2.5, decimal8 5.2; int32: 2.3, shuffle4 3.1).
FILTER_MIN = 4 << 10
FILTER_MAX_RATIO = 4
STREAM_CRC_CHUNK = 8 << 20  # large raw files are checked this much at a time

_local = threading.local()


@dataclass(frozen=True, slots=True)
class Policy:
    mode: str  # "none" | "zstd" | "auto"
    level: int = 3

    @property
    def compresses(self) -> bool:
        return self.mode != "none"

    def __str__(self) -> str:
        return self.mode if self.mode == "none" else f"{self.mode}:{self.level}"


def parse_compress(spec: str) -> Policy:
    """`none` | `zstd[:LEVEL]` | `auto[:LEVEL]`. Raises ValueError on anything else."""
    if spec == "none":
        return Policy("none", 0)
    name, _, level = spec.partition(":")
    if name not in ("zstd", "auto"):
        raise ValueError(f"unknown compression {spec!r} (use auto, zstd, none; LEVEL as zstd:19)")
    if not level:
        return Policy(name, 3)
    if not level.lstrip("-").isdigit() or not -7 <= int(level) <= 22:
        raise ValueError(f"zstd level must be an integer from -7 to 22, not {level!r}")
    return Policy(name, int(level))


# Leading bytes of formats that are compressed already.
_COMPRESSED_MAGIC = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",
    b"GIF87a",
    b"GIF89a",
    b"\x1f\x8b",  # gzip
    b"\x28\xb5\x2f\xfd",  # zstd
    b"\xfd7zXZ\x00",  # xz
    b"BZh",  # bzip2
)
_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_STORED = 0  # compression method of the first member: 0 stored (np.savez), 8 deflate


def delta4(data: bytes | memoryview) -> bytes:
    """The delta4 filter (fanfs/image/filters.py): smooth float32/int32 fields become long runs of
    small values that zstd packs well."""
    return filters.delta(data, 4)


def undelta4(data: bytes) -> bytes:
    """The inverse of `delta4`."""
    return filters.undelta(data, 4)


def already_compressed(head: bytes) -> bool:
    """Whether a file starting with `head` (16 bytes suffice) is in a compressed format."""
    if head.startswith(_ZIP_LOCAL):
        return len(head) >= 10 and struct.unpack_from("<H", head, 8)[0] != _ZIP_STORED
    return head.startswith(_COMPRESSED_MAGIC)


class Encoder:
    """Encodes files under one policy with the image's dictionaries. One per process."""

    def __init__(self, policy: Policy, dicts: Sequence[bytes] = (), frame_size: int = FRAME_SIZE):
        self.policy = policy
        self.dicts = list(dicts)
        self.frame_size = frame_size
        self._plain = zstandard.ZstdCompressor(level=policy.level, write_checksum=True)
        self._with_dict: dict[int, zstandard.ZstdCompressor] = {}

    def _pays(self, stored: int, size: int) -> bool:
        if self.policy.mode == "auto":
            return stored <= size - size // AUTO_MIN_SAVING and stored < size
        return stored < size

    def _compressor(self, dict_id: int) -> zstandard.ZstdCompressor:
        cctx = self._with_dict.get(dict_id)
        if cctx is None:
            d = zstandard.ZstdCompressionDict(self.dicts[dict_id - 1])
            # The frame header names its dictionary (write_dict_id): the reader needs no column.
            cctx = zstandard.ZstdCompressor(
                level=self.policy.level, dict_data=d, write_checksum=True, write_dict_id=True
            )
            self._with_dict[dict_id] = cctx
        return cctx

    def skips(self, head: bytes) -> bool:
        """Whether a file (or a framed file's first frame) starting with `head` is stored raw
        without trying: under auto, formats that are compressed already."""
        return self.policy.mode == "auto" and already_compressed(head[:16])

    def framed(self, size: int) -> bool:
        return self.policy.compresses and size > FRAMED_MIN

    def encode(self, data: bytes, dict_id: int = 0) -> tuple[int, bytes, int]:
        """(codec, stored bytes, CRC-32 for the catalog) of one file held whole."""
        size = len(data)
        if not self.policy.compresses or not data:
            return cat.CODEC_RAW, data, crc32(data)
        skip = self.skips(data[:16])
        if self.framed(size):
            frames = FrameWriter(self, skip)
            view = memoryview(data)
            stored = [
                frames.add(view[i : i + self.frame_size]) for i in range(0, size, self.frame_size)
            ]
            table = frames.table()
            return cat.CODEC_FRAMED, b"".join(stored) + table, crc32(table)
        if not skip:
            if dict_id and size <= DICT_MAX_FILE:
                codec_id, packed = cat.CODEC_ZSTD_DICT, self._compressor(dict_id).compress(data)
            else:
                fid, packed = self._squeeze(data)
                codec_id = cat.CODEC_ZSTD
                if fid == filters.DELTA4:
                    codec_id = cat.CODEC_ZSTD_DELTA4
                elif fid:
                    codec_id, packed = cat.CODEC_ZSTD_FILTERED, bytes((fid,)) + packed
            if self._pays(len(packed), size):
                return codec_id, packed, crc32(packed)
        return cat.CODEC_RAW, data, crc32(data)

    def _squeeze(self, data: bytes | memoryview) -> tuple[int, bytes]:
        """(filter id or 0, zstd bytes): plain zstd, or zstd after the array filter that does
        best on a sample, when that is smaller on the whole. Filters are tried only on binary
        data that plain zstd does not already shrink FILTER_MAX_RATIO times."""
        packed: bytes = self._plain.compress(data)
        if len(packed) * FILTER_MAX_RATIO > len(data) >= FILTER_MIN:
            fid = filters.choose(data, self._plain.compress)
            out = filters.encode(fid, data) if fid else None
            if fid and out is not None:
                alt: bytes = self._plain.compress(out)
                if len(alt) < len(packed):
                    return fid, alt
        return 0, packed

    def encode_frame(self, chunk: bytes | memoryview, skip: bool) -> tuple[int, bytes | memoryview]:
        """(filter id or 0, stored bytes) of one frame; stored raw when compressing does not
        pay."""
        if not skip:
            fid, packed = self._squeeze(chunk)
            if self._pays(len(packed), len(chunk)):
                return fid, packed
        return 0, chunk


class FrameWriter:
    """Builds a framed file frame by frame (so huge files can be streamed); the table of
    (stored length, CRC-32) pairs goes after the frames, and its CRC-32 into the catalog."""

    def __init__(self, encoder: Encoder, skip: bool):
        self.encoder = encoder
        self.skip = skip
        self.entries: list[tuple[int, int]] = []

    def add(self, chunk: bytes | memoryview) -> bytes | memoryview:
        fid, stored = self.encoder.encode_frame(chunk, self.skip)
        self.entries.append((len(stored) | fid << cat.FRAME_FILTER_SHIFT, crc32(stored)))
        return stored

    def table(self) -> bytes:
        return np.array(self.entries, dtype="<u4").reshape(-1, 2).tobytes()


def _decompressor(dict_bytes: bytes | None) -> zstandard.ZstdDecompressor:
    # Keyed by the dictionary's bytes (bytes cache their hash) so images never mix them up.
    cache: dict[bytes | None, zstandard.ZstdDecompressor] = _local.__dict__.setdefault("d", {})
    dctx = cache.get(dict_bytes)
    if dctx is None:
        if dict_bytes is None:
            dctx = zstandard.ZstdDecompressor()
        else:
            dctx = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dict_bytes))
        cache[dict_bytes] = dctx
    return dctx


def train_dictionary(size: int, samples: Sequence[bytes], dict_id: int, level: int) -> bytes:
    """A zstd dictionary of at most `size` bytes trained on `samples`, named `dict_id` in the
    frames made with it. ValueError when zstd cannot train one (too few or too alike)."""
    pool: list[bytes | bytearray | memoryview] = list(samples)
    try:
        trained = zstandard.train_dictionary(size, pool, dict_id=dict_id, level=level)
    except zstandard.ZstdError as e:
        raise ValueError(str(e)) from None
    return bytes(trained.as_bytes())


def streamed_crc(read_at: Callable[[int, int], bytes], start: int, length: int) -> int:
    """CRC-32 of `length` bytes from `start`, read `STREAM_CRC_CHUNK` at a time with
    `read_at(offset, n)`, so a large file is never held whole."""
    crc = 0
    for off in range(0, length, STREAM_CRC_CHUNK):
        crc = crc32(read_at(start + off, min(STREAM_CRC_CHUNK, length - off)), crc)
    return crc


def _zstd(
    stored: bytes | memoryview, size: int, dicts: Sequence[bytes], exact: bool = True
) -> bytes:
    """One zstd frame decoded to `size` bytes (at most `size` unless `exact`)."""
    try:
        dict_id = zstandard.get_frame_parameters(stored).dict_id
        if dict_id and not 1 <= dict_id <= len(dicts):
            raise CorruptFile(f"zstd frame names dictionary {dict_id}, the image has {len(dicts)}")
        dctx = _decompressor(dicts[dict_id - 1] if dict_id else None)
        data: bytes = dctx.decompress(stored, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptFile(f"zstd: {e}") from None
    if len(data) != size and (exact or len(data) > size):
        raise CorruptFile(f"decoded {len(data)} bytes, expected {size}")
    return data


def _unfilter(fid: int, stored: bytes | memoryview, size: int) -> bytes:
    """zstd, then the inverse of filter `fid`, to exactly `size` bytes."""
    if fid not in filters.WIDTH or size % filters.WIDTH[fid]:
        raise CorruptFile(f"filter {fid} does not apply to {size} bytes")
    bound = filters.max_filtered_size(fid, size)
    return filters.decode(fid, _zstd(stored, bound, (), exact=bound == size), size)


@functools.lru_cache(maxsize=8)
def dictionaries(dicts: tuple[bytes, ...]) -> native.Dictionaries:
    """An image's dictionaries made ready for the C decoder once (an image has one set)."""
    return native.Dictionaries(dicts)


def _native_kind(codec: int) -> int:
    if codec == cat.CODEC_RAW:
        return native.lib.KIND_RAW
    if codec in (cat.CODEC_ZSTD, cat.CODEC_ZSTD_DICT):
        return native.lib.KIND_ZSTD
    if codec == cat.CODEC_ZSTD_DELTA4:
        return native.lib.KIND_FILTER + filters.DELTA4
    return native.lib.KIND_FILTERED


def decode_piece(stored: bytes | memoryview, kind: int, size: int,
                 dicts: Sequence[bytes] = ()) -> bytes:  # fmt: skip
    """A checked piece's stored bytes decoded to exactly `size` bytes, by the C decoder (the
    zstandard package where libzstd is missing); CorruptFile if they do not decode."""
    if kind == native.lib.KIND_RAW:
        if len(stored) != size:
            raise CorruptFile(f"stored {len(stored)} bytes raw, expected {size}")
        return stored if isinstance(stored, bytes) else bytes(stored)
    if not native.DECODES:
        return python_decode_piece(stored, kind, size, dicts)
    try:
        return native.decode(stored, kind, size, dictionaries(tuple(dicts)) if dicts else None)
    except native.CorruptPiece as e:
        raise CorruptFile(str(e)) from None


def python_decode_piece(stored: bytes | memoryview, kind: int, size: int,
                        dicts: Sequence[bytes] = ()) -> bytes:  # fmt: skip
    """The zstandard package and fanfs/image/filters.py's decoding of a compressed piece: the
    fallback where libzstd is missing, and the reference the C is tested against."""
    if kind == native.lib.KIND_ZSTD:
        return _zstd(stored, size, dicts)
    if kind == native.lib.KIND_FILTERED and len(stored) > 1:
        return _unfilter(stored[0], memoryview(stored)[1:], size)
    if kind > native.lib.KIND_FILTER:
        return _unfilter(kind - native.lib.KIND_FILTER, stored, size)
    raise CorruptFile("stored bytes do not decode")


def decode(
    stored: bytes, codec: int, size: int, crc: int | None, dicts: Sequence[bytes] = ()
) -> bytes:
    """Check `stored` against its CRC-32 (None: the caller has), then decode it to exactly
    `size` bytes. Framed files are decoded through `FrameTable` instead."""
    if crc is not None and crc32(stored) != crc:
        raise CorruptFile("checksum mismatch")
    if codec == cat.CODEC_FRAMED or codec not in cat.CODEC_NAMES:
        raise CorruptFile(f"codec {codec} cannot be decoded whole")
    return decode_piece(stored, _native_kind(codec), size, dicts)


class FrameTable:
    """The frame table of one framed file: where each frame lies in the stored bytes."""

    def __init__(self, table: bytes, size: int, stored_len: int, frame_size: int, crc: int | None):
        """`crc`: the table's CRC-32, or None when the caller has checked it."""
        n = cat.n_frames(size, frame_size)
        if len(table) != n * cat.FRAME_ENTRY:
            raise CorruptFile("frame table truncated")
        if crc is not None and crc32(table) != crc:
            raise CorruptFile("frame table checksum mismatch")
        pairs = np.frombuffer(table, dtype="<u4").reshape(n, 2)
        self.frame_size = frame_size
        self.size = size
        self.lengths = (pairs[:, 0] & np.uint32(cat.FRAME_LEN_MASK)).astype(np.uint64)
        self.filters = pairs[:, 0] >> np.uint32(cat.FRAME_FILTER_SHIFT)
        self.crcs = pairs[:, 1]
        self.offsets = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        if int(self.offsets[-1]) + len(table) != stored_len:
            raise CorruptFile("frame table does not match the stored length")

    @staticmethod
    def span(size: int, stored_len: int, frame_size: int) -> tuple[int, int]:
        """(offset, length) of the table within the stored bytes."""
        n = cat.n_frames(size, frame_size) * cat.FRAME_ENTRY
        return stored_len - n, n

    def __len__(self) -> int:
        return len(self.crcs)

    @property
    def nbytes(self) -> int:
        """Memory the parsed table holds."""
        return int(self.lengths.nbytes + self.filters.nbytes + self.crcs.nbytes
                   + self.offsets.nbytes)  # fmt: skip

    def stored(self, i: int) -> tuple[int, int]:
        """(offset, length) of frame i within the stored bytes."""
        return int(self.offsets[i]), int(self.lengths[i])

    def decoded_len(self, i: int) -> int:
        return min(self.frame_size, self.size - i * self.frame_size)

    def decode(self, i: int, stored: bytes, checked: bool = False) -> bytes:
        """Check frame i's stored bytes against the table (unless `checked` already), then
        decode them."""
        if not checked and crc32(stored) != int(self.crcs[i]):
            raise CorruptFile(f"frame {i}: checksum mismatch")
        n = self.decoded_len(i)
        fid = int(self.filters[i])
        if fid:
            kind = native.lib.KIND_FILTER + fid
        else:
            kind = native.lib.KIND_RAW if len(stored) == n else native.lib.KIND_ZSTD
        try:
            return decode_piece(stored, kind, n)
        except CorruptFile as e:
            raise CorruptFile(f"frame {i}: {e}") from None
