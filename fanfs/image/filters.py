"""Array filters: reversible transforms that make arrays of numbers compress, applied before zstd.

Each filter reads the data as little-endian words of its width (4 or 8 bytes; the data must be
whole words) and has a one-byte id, the same in whole files (codec zstd-filtered) and frames
(the top 4 bits of a frame's table entry); docs/format.md defines the bytes exactly:

- `shuffle4`, `shuffle8` (as Blosc's shuffle): the words' bytes grouped by significance, all
  byte 0s, then all byte 1s, ...: the slowly varying high bytes of numbers become runs.
- `delta4`, `delta8`: each word minus the previous one (mod 2^32 or 2^64), then shuffled: smooth
  fields and counters become small differences.
- `decimal4`, `decimal8` (after ALP, SIGMOD 2023): float32 / float64 values that are decimals
  stored as binary floats (prices, rounded measurements) become the integers `n` with
  `value == float32(n * 10^-e)` (decimal4: a multiplication by the double nearest 10^-e, the
  cheaper operation, whose last-bit error rounding to float32 hides) or `value == n / 10^e`
  (decimal8: a correctly rounded division, so every decimal comes back), stored as zigzagged
  differences, shuffled; the few values that do not round-trip (NaN, -0.0, a stray header) are
  kept verbatim as exceptions.

Lossless always: `decode(fid, encode(fid, data)) == data` for every input an encoder accepts, and
each decoder checks the sizes it is given (CorruptFile), since stored bytes may be hostile. The
C extension decodes the same bytes (fanfs/csrc/filters.c, used by every path); tests
compare the two on every filter.

`choose(data)` picks the filter to try for a block: each candidate compresses a sample, the
smallest wins; None when no filter applies.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from fanfs.errors import CorruptFile

SHUFFLE4, SHUFFLE8, DELTA8, DECIMAL4, DECIMAL8, DELTA4 = 1, 2, 3, 4, 5, 8
NAMES = {SHUFFLE4: "shuffle4", SHUFFLE8: "shuffle8", DELTA8: "delta8", DECIMAL4: "decimal4",
         DECIMAL8: "decimal8", DELTA4: "delta4"}  # fmt: skip
WIDTH = {SHUFFLE4: 4, SHUFFLE8: 8, DELTA8: 8, DECIMAL4: 4, DECIMAL8: 8, DELTA4: 4}
SAMPLE = 64 << 10  # bytes of a block that `choose` tries the filters on

# decimal: header (exponent, 3 zero bytes, exception count), then the exceptions' positions
# (u32 each) and original words, then the shuffled zigzag differences.
_DECIMAL_HEAD = struct.Struct("<B3xI")
_DECIMAL_MAX_EXP = {4: 10, 8: 18}  # 10^e exactly representable as a double up to 10^22
# |n| below these: every difference fits the word (zigzagged), and n converts to a double exactly.
_DECIMAL_MAX_N = {4: 1 << 30, 8: 1 << 52}
_DECIMAL_MIN_EXACT = 0.9  # below this share of values that round-trip, decimal does not apply
_UINT: dict[int, np.dtype[Any]] = {4: np.dtype("<u4"), 8: np.dtype("<u8")}
_INT: dict[int, np.dtype[Any]] = {4: np.dtype("<i4"), 8: np.dtype("<i8")}
_FLOAT: dict[int, np.dtype[Any]] = {4: np.dtype("<f4"), 8: np.dtype("<f8")}


Buffer = bytes | memoryview | np.ndarray[Any, Any]


def shuffle(data: Buffer, width: int) -> bytes:
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width).T.tobytes()


def unshuffle(data: bytes | memoryview, width: int) -> bytes:
    planes = np.frombuffer(data, dtype=np.uint8).reshape(width, -1)
    return np.ascontiguousarray(planes.T).tobytes()


def delta(data: bytes | memoryview, width: int) -> bytes:
    u = np.frombuffer(data, dtype=_UINT[width])
    d = np.empty_like(u)
    d[:1] = u[:1]
    np.subtract(u[1:], u[:-1], out=d[1:])
    return shuffle(d.view(np.uint8), width)


def undelta(data: bytes | memoryview, width: int) -> bytes:
    d = np.frombuffer(unshuffle(data, width), dtype=_UINT[width])
    return np.cumsum(d, dtype=_UINT[width]).astype(_UINT[width], copy=False).tobytes()


def _scaled(n: np.ndarray, e: int, width: int) -> np.ndarray:
    """The decimal filter's values of the integers `n` (float64) at exponent `e`, as words: the
    one formula both the encoder's check and every decoder (C too) apply."""
    # decimal4: times the double nearest 10^-e, parsed from the same literal as in C.
    v = n * float(f"1e-{e}") if width == 4 else n / float(f"1e{e}")
    return v.astype(_FLOAT[width]).view(_UINT[width])


def _exponent(v: np.ndarray, width: int) -> int | None:
    """The smallest decimal exponent at which most of the sample `v` (as float64) round-trips."""
    sample = v[:: max(1, len(v) // 4096)]
    finite = sample[np.isfinite(sample)]
    if len(finite) < len(sample) * _DECIMAL_MIN_EXACT:
        return None
    bits = sample.astype(_FLOAT[width]).view(_UINT[width])
    for e in range(_DECIMAL_MAX_EXP[width] + 1):
        back = _scaled(np.rint(sample * 10.0**e), e, width)
        if np.count_nonzero(back == bits) >= len(sample) * _DECIMAL_MIN_EXACT:
            return e
    return None


def decimal(data: bytes | memoryview, width: int) -> bytes | None:
    """The decimal filter's output, or None when the values are not decimals."""
    with np.errstate(all="ignore"):  # NaN, inf and overflows are exceptions, not errors
        return _decimal(data, width)


def _decimal(data: bytes | memoryview, width: int) -> bytes | None:
    orig = np.frombuffer(data, dtype=_UINT[width])
    v = orig.view(_FLOAT[width]).astype(np.float64)
    e = _exponent(v, width)
    if e is None:
        return None
    scale = 10.0**e
    n = np.rint(v * scale)
    ok = np.isfinite(n) & (np.abs(n) < _DECIMAL_MAX_N[width])
    n = np.where(ok, n, 0).astype(np.int64)
    ok &= _scaled(n.astype(np.float64), e, width) == orig
    bad = np.flatnonzero(~ok).astype("<u4")
    if len(bad) > len(orig) * (1 - _DECIMAL_MIN_EXACT):
        return None
    if len(bad):  # an exception repeats the value before it: its difference is 0
        last_ok = np.where(ok, np.arange(len(n)), 0)
        np.maximum.accumulate(last_ok, out=last_ok)
        n = np.where(ok[last_ok], n[last_ok], 0)
    d = np.empty_like(n)
    d[:1] = n[:1]
    np.subtract(n[1:], n[:-1], out=d[1:])
    zigzag = ((d << 1) ^ (d >> 63)).astype(_UINT[width])
    return b"".join((_DECIMAL_HEAD.pack(e, len(bad)), bad.tobytes(), orig[bad].tobytes(),
                     shuffle(zigzag.view(np.uint8), width)))  # fmt: skip


def undecimal(data: bytes | memoryview, width: int, size: int) -> bytes:
    """The inverse of `decimal`, to exactly `size` bytes (CorruptFile if it cannot be)."""
    if len(data) < _DECIMAL_HEAD.size:
        raise CorruptFile("decimal filter: truncated header")
    e, k = _DECIMAL_HEAD.unpack_from(data)
    words = size // width
    body = _DECIMAL_HEAD.size + k * (4 + width)
    if e > _DECIMAL_MAX_EXP[width] or k > words or len(data) != body + size:
        raise CorruptFile("decimal filter: sizes do not match")
    pos = np.frombuffer(data, dtype="<u4", count=k, offset=_DECIMAL_HEAD.size)
    if k and int(pos.max()) >= words:
        raise CorruptFile("decimal filter: exception out of range")
    kept = np.frombuffer(data, dtype=_UINT[width], count=k, offset=_DECIMAL_HEAD.size + 4 * k)
    z = np.frombuffer(unshuffle(memoryview(data)[body:], width), dtype=_UINT[width])
    one = _UINT[width].type(1)
    d = (z >> one) ^ (_UINT[width].type(0) - (z & one))  # unzigzagged, as unsigned words
    # The running sum wraps at the word's width (decimal4: int32, as the C decoder sums).
    n = np.cumsum(d, dtype=_UINT[width]).view(_INT[width])
    with np.errstate(all="ignore"):  # hostile integers may overflow float32: still defined
        out = _scaled(n.astype(np.float64), e, width)
    out[pos] = kept
    return bytes(out.tobytes())


_ENCODE: dict[int, Callable[[bytes | memoryview], bytes | None]] = {
    SHUFFLE4: lambda b: shuffle(b, 4),
    SHUFFLE8: lambda b: shuffle(b, 8),
    DELTA4: lambda b: delta(b, 4),
    DELTA8: lambda b: delta(b, 8),
    DECIMAL4: lambda b: decimal(b, 4),
    DECIMAL8: lambda b: decimal(b, 8),
}


def encode(fid: int, data: bytes | memoryview) -> bytes | None:
    """Filter `data` (whole words of the filter's width) with filter `fid`; None if it does not
    apply (decimal on values that are not decimals)."""
    return _ENCODE[fid](data)


def decode(fid: int, data: bytes | memoryview, size: int) -> bytes:
    """Undo filter `fid`, giving exactly `size` bytes; CorruptFile on anything that does not fit."""
    width = WIDTH.get(fid)
    if width is None:
        raise CorruptFile(f"unknown filter {fid}")
    if size % width:
        raise CorruptFile(f"{NAMES[fid]}: {size} bytes are not whole words")
    if fid in (DECIMAL4, DECIMAL8):
        return undecimal(data, width, size)
    if len(data) != size:
        raise CorruptFile(f"{NAMES[fid]}: {len(data)} bytes, expected {size}")
    if fid in (DELTA4, DELTA8):
        return undelta(data, width)
    return unshuffle(data, width)


def max_filtered_size(fid: int, size: int) -> int:
    """The most bytes filter `fid`'s output of `size` bytes can have (its exact size but for
    decimal, whose exceptions add to it)."""
    width = WIDTH[fid]
    if fid in (DECIMAL4, DECIMAL8):
        return _DECIMAL_HEAD.size + size // width * (4 + width) + size
    return size


def candidates(size: int) -> list[int]:
    """Filters that apply to a block of `size` bytes (whole words)."""
    fids = [DELTA4, SHUFFLE4, DECIMAL4] if size % 4 == 0 else []
    if size % 8 == 0:
        fids += [DELTA8, SHUFFLE8, DECIMAL8]
    return fids


def _text(sample: bytes | memoryview) -> bool:
    """Whether `sample` has no control bytes but whitespace (text, CSV: not numbers in binary)."""
    b = np.frombuffer(sample, dtype=np.uint8)
    return not np.any(((b < 32) & ((b < 9) | (b > 13))) | (b == 127))


def choose(data: bytes | memoryview, compress: Callable[[bytes | memoryview], bytes]) -> int | None:
    """The filter whose output of a sample of `data` compresses smallest, or None if none
    applies. The sample is taken from the middle, whole 8-byte words."""
    fids = candidates(len(data))
    if not fids:
        return None
    start = max(0, (len(data) - SAMPLE) // 2) & ~7
    sample = memoryview(data)[start : start + SAMPLE]  # all of it, or whole 8-byte words
    if _text(sample):
        return None
    best, best_len = None, len(compress(sample))
    for fid in fids:
        if len(sample) % WIDTH[fid]:
            continue
        out = encode(fid, sample)
        if out is not None and len(packed := compress(out)) < best_len:
            best, best_len = fid, len(packed)
    return best
