#!/usr/bin/env python3
"""Compression that pays? For three kinds of generated data (JPEG images, smooth float32 fields,
CSV tables) prepare the same files raw (`--compress none`) and with `--compress auto`, then read
every file whole, in a random order, through both mounts (and natively, for context), caches
dropped before each pass, alternating so drift hits all alike.

Reports per kind: the compression ratio, prepare throughput (source MB/s) of both, and the read
throughput of the compressed image relative to the raw one (median of the repeats, with min
and max). Run as root so caches can be dropped. Results: docs/performance.md.

    python tools/compress_bench.py --mib 200 --readers 2 --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fanfs import bench, datagen
from fanfs.bench import launch
from fanfs.catalog import Catalog


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


KINDS: dict[str, tuple[str, Callable[[np.random.Generator], bytes]]] = {
    "jpeg": (".jpg", _jpeg),
    "float32": (".f32", _field),
    "csv": (".csv", _csv),
}


def generate(root: Path, kind: str, total: int, seed: int) -> list[str]:
    ext, make = KINDS[kind]
    rng = np.random.default_rng(seed)
    rels: list[str] = []
    done = 0
    while done < total:
        rel = f"d{len(rels) % 8}/{kind}{len(rels):06d}{ext}"
        data = make(rng)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        rels.append(rel)
        done += len(data)
    return rels


def _prepare(src: Path, image: Path, compress: str) -> float:
    bench.drop_caches()
    began = time.monotonic()
    launch.check("-q", "prepare", src, image, "--compress", compress, timeout=1800)
    return time.monotonic() - began


def run_kind(work: Path, kind: str, total: int, readers: int, repeat: int) -> dict[str, object]:
    base = work / kind
    shutil.rmtree(base, ignore_errors=True)
    src = base / "src"
    rels = generate(src, kind, total, seed=len(kind))
    nbytes = sum((src / r).stat().st_size for r in rels)
    seconds = {c: _prepare(src, base / f"img-{c}", c) for c in ("none", "auto")}
    catalog, _ = Catalog.load(base / "img-auto")
    stored = int(catalog.stored_len[catalog.is_file].sum())
    case = bench.Case(0, readers, "cold", kind)
    results: dict[str, list[bench.Result]] = {"native": [], "raw": [], "auto": []}
    with (
        bench.serving(base / "img-none", base / "m-none", 1) as raw,
        bench.serving(base / "img-auto", base / "m-auto", 1) as auto,
    ):
        roots = {"native": src, "raw": raw.mnts[0], "auto": auto.mnts[0]}
        for i in range(repeat):
            for name, root in roots.items():
                results[name].append(bench.measure(case, name, root, rels, seed=i))
    shutil.rmtree(base, ignore_errors=True)

    def mb_s(name: str) -> float:
        return statistics.median(r.nbytes / r.seconds / 1e6 for r in results[name])

    ratios = [a.files_per_s / r.files_per_s for a, r in zip(results["auto"], results["raw"],
                                                            strict=True)]  # fmt: skip
    return {
        "kind": kind,
        "files": len(rels),
        "bytes": nbytes,
        "bytes_stored": stored,
        "ratio": nbytes / stored,
        "prepare_raw_mb_s": nbytes / seconds["none"] / 1e6,
        "prepare_auto_mb_s": nbytes / seconds["auto"] / 1e6,
        "read_native_mb_s": mb_s("native"),
        "read_raw_mb_s": mb_s("raw"),
        "read_auto_mb_s": mb_s("auto"),
        "read_auto_vs_raw": statistics.median(ratios),
        "read_auto_vs_raw_min": min(ratios),
        "read_auto_vs_raw_max": max(ratios),
        "codecs": {name: int(n) for name, n in _codecs(catalog).items() if n},
    }


def _codecs(c: Catalog) -> dict[str, int]:
    from fanfs.catalog import CODEC_NAMES

    return {name: int((c.codec[c.is_file] == cid).sum()) for cid, name in CODEC_NAMES.items()}


def format_table(rows: list[dict[str, object]]) -> str:
    head = (f"{'kind':8} {'files':>6} {'MiB':>6} {'ratio':>6} {'prep raw':>9} {'prep auto':>9} "
            f"{'native':>7} {'raw':>7} {'auto':>7} {'auto/raw (min-max)':>19}  codecs")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kind']:8} {r['files']:>6} {int(r['bytes']) / 2**20:6.0f} {r['ratio']:6.2f} "  # type: ignore[call-overload]
            f"{r['prepare_raw_mb_s']:9.0f} {r['prepare_auto_mb_s']:9.0f} "
            f"{r['read_native_mb_s']:7.0f} {r['read_raw_mb_s']:7.0f} {r['read_auto_mb_s']:7.0f} "
            f"{r['read_auto_vs_raw']:6.2f} ({r['read_auto_vs_raw_min']:.2f}-"
            f"{r['read_auto_vs_raw_max']:.2f})  {r['codecs']}"
        )
    lines.append("(prepare and read columns: MB/s of source bytes; reads cold, whole files)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/fanfs-compress-bench")
    ap.add_argument("--mib", type=int, default=200, help="MiB of source data per kind")
    ap.add_argument("--kinds", default="jpeg,float32,csv")
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not bench.drop_caches():
        print("compress_bench: cannot drop caches (not root): reads are not cold", file=sys.stderr)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in args.kinds.split(","):
        print(f"compress_bench: {kind}: {args.mib} MiB", flush=True)
        rows.append(run_kind(work, kind, args.mib << 20, args.readers, args.repeat))
        print(format_table(rows[-1:]).splitlines()[-2], flush=True)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
