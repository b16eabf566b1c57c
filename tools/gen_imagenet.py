"""Generate a namespace shaped like ImageNet: train/ and val/, 1000 class directories each.

Usage: python tools/gen_imagenet.py DEST [--classes 1000] [--train 1300] [--val 50]
       [--min-bytes 256] [--max-bytes 2048] [--jobs 2]

1,331,000 files in 2,002 directories by default, with small files (256 B to 2 KiB, random after
a JPEG start-of-image marker, as real JPEGs begin, so `--compress auto` treats them as it would
ImageNet) so that it fits a developer machine's disk: the point is the namespace, not the bytes.
Names follow ImageNet's (n01440764/n01440764_10026.JPEG). Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

SOI = b"\xff\xd8\xff\xe0"  # JPEG start of image + APP0, the first bytes of a JFIF file


def make_class(dest: str, c: int, n_train: int, n_val: int, lo: int, hi: int) -> int:
    rng = np.random.default_rng(c)
    wnid = f"n{1440764 + c * 7919:08d}"
    blob = rng.bytes(hi * 64)
    written = 0
    for split, n in (("train", n_train), ("val", n_val)):
        d = os.path.join(dest, split, wnid)
        os.makedirs(d, exist_ok=True)
        sizes = rng.integers(lo, hi + 1, n)
        offs = rng.integers(0, len(blob) - hi, n)
        for i in range(n):
            name = (
                f"{wnid}_{i}.JPEG"
                if split == "train"
                else f"ILSVRC2012_val_{c * n_val + i:08d}.JPEG"
            )
            fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, SOI + blob[offs[i] + len(SOI) : offs[i] + sizes[i]])
            finally:
                os.close(fd)
            written += 1
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--train", type=int, default=1300)
    ap.add_argument("--val", type=int, default=50)
    ap.add_argument("--min-bytes", type=int, default=256)
    ap.add_argument("--max-bytes", type=int, default=2048)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    start = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        sizes = (args.min_bytes, args.max_bytes)
        jobs = [pool.submit(make_class, str(args.dest), c, args.train, args.val, *sizes)
                for c in range(args.classes)]  # fmt: skip
        total = sum(j.result() for j in jobs)
    secs = time.monotonic() - start
    print(f"gen_imagenet: {total} files in {2 * args.classes + 2} directories under {args.dest} "
          f"in {secs:.0f} s ({total / secs:.0f} files/s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
