#!/usr/bin/env python3
"""Compression that pays? For each kind of generated data (JPEG images, CSV tables, float32
arrays smooth, rounded to decimals and noisy, int32 arrays) prepare the same files raw
(`--compress none`) and with `--compress auto`, then read every file whole, in a random order,
through both mounts and natively (for context): cold (caches dropped before each pass) and
warm, with 1 and 4 reader processes, alternating so drift hits all alike.

Reports per kind: the compression ratio of auto and of zstd alone (every file compressed whole
at the same level, for comparison), prepare throughput (source MB/s) of both images, and per
case (cold/warm, readers) the read throughput of the auto image relative to the raw one (median
of the repeats, with min and max). Run as root so caches can be dropped. Results:
docs/performance.md "Compression".

    python tools/compress_bench.py --mib 100 --repeat 3 --json docs/compress-bench.json
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from fanfs import bench
from fanfs.bench import datagen, launch
from fanfs.image.catalog import CODEC_NAMES, CODEC_ZSTD_FILTERED, Catalog


def _jpeg(rng: np.random.Generator) -> bytes:
    """A photo-like JPEG: smooth colour fields plus sensor noise, 224x224, quality 90."""
    from PIL import Image

    rgb = np.stack([datagen.smooth_field(rng, 224, 224, 0.03) for _ in range(3)], axis=-1)
    rgb = (rgb - rgb.min()) / (np.ptp(rgb) or 1) * 230 + rng.normal(0, 4, rgb.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _field(rng: np.random.Generator) -> bytes:
    """A simulation snapshot: a smooth float32 field, 1 MiB (512x512) or 16 MiB (2048x2048)."""
    n = 2048 if rng.random() < 0.125 else 512
    return datagen.smooth_field(rng, n, n).tobytes()


def _csv(rng: np.random.Generator) -> bytes:
    return datagen.csv_table(rng, int(rng.integers(50, 3000)))


def _n_values(rng: np.random.Generator) -> int:
    """1 MiB of float32 or int32, or one in eight 8 MiB (framed)."""
    return (2 << 20) if rng.random() < 0.125 else (256 << 10)


def _decimals(rng: np.random.Generator) -> bytes:
    """Prices or rounded measurements: a random walk rounded to two decimals, stored float32."""
    walk = 100 + np.cumsum(rng.normal(0, 1, _n_values(rng)))
    return walk.round(2).astype(np.float32).tobytes()


def _noisy(rng: np.random.Generator) -> bytes:
    """Sensor noise: float32 values with no structure beyond their range."""
    return rng.normal(280, 5, _n_values(rng)).astype(np.float32).tobytes()


def _ints(rng: np.random.Generator) -> bytes:
    """Token ids or class labels: int32 below 30,000, with no order."""
    return rng.integers(0, 30_000, _n_values(rng)).astype(np.int32).tobytes()


KINDS: dict[str, tuple[str, Callable[[np.random.Generator], bytes]]] = {
    "jpeg": (".jpg", _jpeg),
    "csv": (".csv", _csv),
    "f32-smooth": (".f32", _field),
    "f32-decimal": (".f32", _decimals),
    "f32-noisy": (".f32", _noisy),
    "i32": (".i32", _ints),
}
CASES = [(temp, readers) for temp in ("cold", "warm") for readers in (1, 4)]


def generate(root: Path, kind: str, total: int, seed: int) -> tuple[list[str], int]:
    """(the files made, their bytes compressed by zstd alone at the default level)."""
    ext, make = KINDS[kind]
    rng = np.random.default_rng(seed)
    zstd = zstandard.ZstdCompressor(level=3)
    rels: list[str] = []
    done = packed = 0
    while done < total:
        rel = f"d{len(rels) % 8}/{kind}{len(rels):06d}{ext}"
        data = make(rng)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        rels.append(rel)
        done += len(data)
        packed += min(len(zstd.compress(data)), len(data))
    return rels, packed


def _prepare(src: Path, image: Path, compress: str) -> float:
    bench.drop_caches()
    began = time.monotonic()
    launch.check("-q", "prepare", src, image, "--compress", compress, timeout=1800)
    return time.monotonic() - began


def run_kind(work: Path, kind: str, total: int, repeat: int) -> dict[str, object]:
    base = work / kind
    base.mkdir()  # in the run's own scratch directory
    src = base / "src"
    rels, zstd_bytes = generate(src, kind, total, seed=len(kind))
    nbytes = sum((src / r).stat().st_size for r in rels)
    seconds = {c: _prepare(src, base / f"img-{c}", c) for c in ("none", "auto")}
    catalog, _ = Catalog.load(base / "img-auto")
    stored = int(catalog.stored_len[catalog.is_file].sum())
    codecs = {name: int(n) for name, n in _codecs(catalog, base / "img-auto").items() if n}
    results: dict[tuple[str, int, str], list[bench.Result]] = {}
    with (
        bench.serving(base / "img-none", base / "m-none", 1) as raw,
        bench.serving(base / "img-auto", base / "m-auto", 1) as auto,
    ):
        roots = {"native": src, "raw": raw.mnts[0], "auto": auto.mnts[0]}
        for i in range(repeat):
            for temp, readers in CASES:
                case = bench.Case(0, readers, temp, kind)
                for name, root in roots.items():
                    got = bench.measure(case, name, root, rels, seed=i)
                    results.setdefault((temp, readers, name), []).append(got)
    shutil.rmtree(base, ignore_errors=True)
    cases = []
    for temp, readers in CASES:
        by = {name: results[temp, readers, name] for name in ("native", "raw", "auto")}
        ratios = [a.files_per_s / r.files_per_s for a, r in zip(by["auto"], by["raw"], strict=True)]
        row: dict[str, object] = {"temp": temp, "readers": readers}
        for name, rs in by.items():
            row[f"{name}_mb_s"] = statistics.median(r.nbytes / r.seconds / 1e6 for r in rs)
        row.update(auto_vs_raw=statistics.median(ratios), auto_vs_raw_min=min(ratios),
                   auto_vs_raw_max=max(ratios))  # fmt: skip
        cases.append(row)
    return {
        "kind": kind,
        "files": len(rels),
        "bytes": nbytes,
        "bytes_stored": stored,
        "ratio": nbytes / stored,
        "ratio_zstd_alone": nbytes / zstd_bytes,
        "prepare_raw_mb_s": nbytes / seconds["none"] / 1e6,
        "prepare_auto_mb_s": nbytes / seconds["auto"] / 1e6,
        "codecs": codecs,
        "cases": cases,
    }


def _codecs(c: Catalog, image: Path) -> dict[str, int]:
    """Files per codec; zstd-filtered and framed files also by the filter of their first byte
    or frames (names from fanfs.image.filters)."""
    from fanfs.image import filters

    files = c.is_file
    counts = {name: int((c.codec[files] == cid).sum()) for cid, name in CODEC_NAMES.items()}
    for entry in np.flatnonzero(files & (c.codec == CODEC_ZSTD_FILTERED)):
        fid = _first_byte(c, image, int(entry))
        key = f"zstd-{filters.NAMES.get(fid, fid)}"
        counts[key] = counts.get(key, 0) + 1
    if counts.get("zstd-filtered"):
        del counts["zstd-filtered"]
    return counts


def _first_byte(c: Catalog, image: Path, entry: int) -> int:
    from fanfs.image.catalog import partition_name

    with open(image / partition_name(int(c.part[entry])), "rb") as f:
        f.seek(int(c.data_off[entry]))
        return f.read(1)[0]


def format_table(rows: list[dict[str, object]]) -> str:
    head = (f"{'kind':12} {'files':>6} {'MiB':>5} {'ratio':>5} {'zstd':>5} {'prep raw':>8} "
            f"{'auto':>5}  {'case':8} {'native':>7} {'raw':>7} {'auto':>7} "
            f"{'auto/raw (min-max)':>19}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        first = (f"{r['kind']:12} {r['files']:>6} {int(r['bytes']) / 2**20:5.0f} "  # type: ignore[call-overload]
                 f"{r['ratio']:5.2f} {r['ratio_zstd_alone']:5.2f} {r['prepare_raw_mb_s']:8.0f} "
                 f"{r['prepare_auto_mb_s']:5.0f}")  # fmt: skip
        for i, c in enumerate(r["cases"]):  # type: ignore[attr-defined]
            lead = first if i == 0 else " " * len(first)
            lines.append(
                f"{lead}  {c['temp']:4} {c['readers']}rd {c['native_mb_s']:7.0f} "
                f"{c['raw_mb_s']:7.0f} {c['auto_mb_s']:7.0f} {c['auto_vs_raw']:6.2f} "
                f"({c['auto_vs_raw_min']:.2f}-{c['auto_vs_raw_max']:.2f})"
            )
        lines.append(f"{'':12} codecs: {r['codecs']}")
    lines.append("(ratio: auto; zstd: zstd alone on every file; prepare and read: MB/s of "
                 "source bytes, whole files, random order)")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=tempfile.gettempdir(),
                    help="where the run makes its own directory (default: $TMPDIR)")  # fmt: skip
    ap.add_argument("--mib", type=int, default=100, help="MiB of source data per kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not bench.drop_caches():
        print("compress_bench: cannot drop caches (not root): reads are not cold", file=sys.stderr)
    rows = []
    with launch.scratch(args.workdir, "fanfs-compress-bench") as work:
        for kind in args.kinds.split(","):
            print(f"compress_bench: {kind}: {args.mib} MiB", flush=True)
            rows.append(run_kind(work, kind, args.mib << 20, args.repeat))
            print(format_table(rows[-1:]), flush=True)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
