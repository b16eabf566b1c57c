#!/usr/bin/env python3
"""How fast fanfs decodes a filtered array against zstd's own decode of the same frame, per core.

Each array is one frame (1 MiB decoded, fanfs.image.format.FRAME_SIZE) encoded as `fanfs
prepare --compress auto` encodes it (fanfs.image.codec.Encoder: the array filter auto picks,
or with --every-filter each filter that applies), then timed in one thread, alternating round
by round so drift hits all alike:

  memcpy  a plain copy of the decoded size (ctypes.memmove between two buffers);
  zstd    libzstd's own one-shot decode of the same zstd frame (ZSTD_decompressDCtx, one
          context, a buffer kept: the library fanfs's C loads; filtered frames never use a
          dictionary, so none is given), checking the frame's content checksum (XXH64);
  zstd-nx the same, skipping the content checksum (ZSTD_d_forceIgnoreChecksum), as fanfs's C
          does: its CRC-32 of the stored frame is checked before any decode;
  fanfs   the C decoder with its filter, as the pool and every Python caller run it
          (fanfs._native.decode: fanfs_decode, GIL released), checked byte for byte once;
  with --widths, the filter's pass alone (the bytes zstd gave, undone) at each vector width
          this CPU runs (fanfs._native.unfilter: 0 the portable C, 128 SSE2, 256 AVX2 and
          FMA), in microseconds per frame; every width must give the frame's bytes.

Reports GB/s of decoded bytes (median of the rounds) and fanfs/zstd, the share of zstd's own
speed the decoder keeps (the median of each round's: load from elsewhere comes and goes). A
`zstd` row (no filter) is the control: fanfs/zstd-nx should be 1.
Results: docs/performance.md, "Compression".

    nice -n 10 python tools/decode_bench.py --rounds 9
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import zstandard

from fanfs import native
from fanfs.bench import datagen
from fanfs.image import codec, filters
from fanfs.image.format import FRAME_SIZE

WORDS4, WORDS8 = FRAME_SIZE // 4, FRAME_SIZE // 8
SLICE_S = 0.02  # seconds of repeated decodes per timing: far above the clock's resolution


def arrays(rng: np.random.Generator) -> dict[str, bytes]:
    """One frame of each kind of array tools/compress_bench.py reads, and float64 ones."""
    walk4, walk8 = np.cumsum(rng.normal(0, 1, WORDS4)), np.cumsum(rng.normal(0, 1, WORDS8))
    csv = b"".join(datagen.csv_table(rng, 3000) for _ in range(8))
    return {
        "csv": csv[:FRAME_SIZE],
        "f32-smooth": datagen.smooth_field(rng, 512, 512).tobytes(),
        "f32-decimal": (100 + walk4).round(2).astype(np.float32).tobytes(),
        "f32-noisy": rng.normal(280, 5, WORDS4).astype(np.float32).tobytes(),
        "i32": rng.integers(0, 30_000, WORDS4).astype(np.int32).tobytes(),
        "f64-smooth": datagen.smooth_field(rng, 256, 512).astype(np.float64).tobytes(),
        "f64-decimal": (100 + walk8).round(2).tobytes(),
    }


def frames(data: bytes, every: bool, enc: codec.Encoder) -> list[tuple[int, bytes]]:
    """(filter id or 0, zstd frame) for `data`: auto's choice, or every filter that applies."""
    if not every:
        fid, packed = enc.encode_frame(data, skip=False)
        return [(fid, bytes(packed))]
    out, plain = [], zstandard.ZstdCompressor(level=enc.policy.level, write_checksum=True)
    for fid in filters.candidates(len(data)):
        filtered = filters.encode(fid, data)
        if filtered is not None:
            out.append((fid, plain.compress(filtered)))
    return out


class Zstd:
    """libzstd.so.1 through ctypes: one decompression context, reused; with `unchecked`, it
    skips the frames' content checksum as fanfs's C does (ZSTD_d_forceIgnoreChecksum)."""

    def __init__(self, unchecked: bool = False) -> None:
        self.lib = ctypes.CDLL("libzstd.so.1")
        self.lib.ZSTD_createDCtx.restype = ctypes.c_void_p
        self.lib.ZSTD_isError.argtypes, self.lib.ZSTD_isError.restype = (
            [ctypes.c_size_t],
            ctypes.c_uint,
        )
        f = self.lib.ZSTD_decompressDCtx
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                      ctypes.c_size_t]  # fmt: skip
        self.dctx = self.lib.ZSTD_createDCtx()
        if unchecked:  # zstd.h: ZSTD_d_forceIgnoreChecksum (1002), ZSTD_d_ignoreChecksum (1)
            self.lib.ZSTD_DCtx_setParameter.restype = ctypes.c_size_t
            self.lib.ZSTD_DCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            if self.lib.ZSTD_isError(self.lib.ZSTD_DCtx_setParameter(self.dctx, 1002, 1)):
                raise SystemExit("decode_bench: this libzstd cannot skip content checksums")

    def decoder(self, frame: bytes, cap: int) -> Callable[[], object]:
        out = ctypes.create_string_buffer(cap)
        got = self.lib.ZSTD_decompressDCtx(self.dctx, out, cap, frame, len(frame))
        if self.lib.ZSTD_isError(got):
            raise SystemExit("decode_bench: libzstd cannot decode the frame")
        return lambda: self.lib.ZSTD_decompressDCtx(self.dctx, out, cap, frame, len(frame))


def seconds_each(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes, over about SLICE_S of calls."""
    n, began = 0, time.perf_counter()
    while (spent := time.perf_counter() - began) < SLICE_S or n < 3:
        fn()
        n += 1
    return spent / n


def widths() -> list[int]:
    """The vector widths the filters' pass can be run at on this CPU."""
    return [w for w in (0, 128, 256) if w <= native.lib.vectors()]


def run_case(data: bytes, fid: int, frame: bytes, zstd: Zstd, unchecked: Zstd,
             rounds: int, by_width: bool) -> dict[str, float]:  # fmt: skip
    size = len(data)
    kind = native.lib.KIND_ZSTD if fid == 0 else native.lib.KIND_FILTER + fid
    if native.decode(frame, kind, size) != data:
        raise SystemExit(f"decode_bench: fanfs decodes filter {fid} wrongly")
    src, dst = ctypes.create_string_buffer(data, size), ctypes.create_string_buffer(size)
    cap = filters.max_filtered_size(fid, size) if fid else size
    ways: dict[str, Callable[[], object]] = {
        "memcpy": lambda: ctypes.memmove(dst, src, size),
        "zstd": zstd.decoder(frame, cap),
        "zstd-nx": unchecked.decoder(frame, cap),
        "fanfs": lambda: native.decode(frame, kind, size),
    }
    if by_width and fid:
        filtered = zstandard.ZstdDecompressor().decompress(frame)
        for w in widths():
            if native.lib.unfilter(filtered, fid, size, w) != data:
                raise SystemExit(f"decode_bench: {w}-bit vectors undo filter {fid} wrongly")
            ways[f"pass{w}"] = functools.partial(native.lib.unfilter, filtered, fid, size, w)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            times[name].append(seconds_each(fn))
    row = {name: size / statistics.median(ts) / 1e9 for name, ts in times.items()}
    row.update({name: statistics.median(ts) * 1e6 for name, ts in times.items()
                if name.startswith("pass")})  # fmt: skip
    row["ratio"] = size / len(frame)
    # Per round, so that load from elsewhere (which comes and goes) cancels out.
    for base, key in (("zstd", "share"), ("zstd-nx", "share_nx")):
        pairs = zip(times[base], times["fanfs"], strict=True)
        row[key] = statistics.median(z / f for z, f in pairs)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--every-filter", action="store_true",
                    help="each filter that applies, not only auto's choice")  # fmt: skip
    ap.add_argument("--widths", action="store_true",
                    help="also time the filter's pass alone at each vector width")  # fmt: skip
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not native.DECODES:
        print("decode_bench: libzstd.so.1 is missing: fanfs's C cannot decode", file=sys.stderr)
        return 1
    zstd, unchecked = Zstd(), Zstd(unchecked=True)
    enc = codec.Encoder(codec.parse_compress("auto"))
    print(f"{'array':12} {'filter':9} {'ratio':>5} {'memcpy':>7} {'zstd':>6} {'zstd-nx':>7} "
          f"{'fanfs':>6} {'fanfs/zstd':>10} {'/zstd-nx':>8}"
          + "".join(f" {f'pass{w}':>7}" for w in (widths() if args.widths else [])))  # fmt: skip
    for name, data in arrays(np.random.default_rng(args.seed)).items():
        for fid, frame in frames(data, args.every_filter, enc):
            r = run_case(data, fid, frame, zstd, unchecked, args.rounds, args.widths)
            label = filters.NAMES.get(fid, "zstd")
            print(f"{name:12} {label:9} {r['ratio']:5.2f} {r['memcpy']:7.2f} {r['zstd']:6.2f} "
                  f"{r['zstd-nx']:7.2f} {r['fanfs']:6.2f} {r['share']:10.2f} "
                  f"{r['share_nx']:8.2f}"
                  + "".join(f" {v:7.0f}" for k, v in r.items() if k.startswith("pass")),
                  flush=True)  # fmt: skip
    print(f"(GB/s of decoded bytes, one thread, median of {args.rounds} rounds; frames of "
          f"{FRAME_SIZE >> 20} MiB; zstd-nx: libzstd skipping the content checksum, as fanfs "
          "does after its CRC-32 of the stored frame"
          + ("; passN: the filter's pass alone with N-bit vectors, us a frame" if args.widths
             else "") + ")")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
