"""Walk a namespace the way data loaders do, through fanfs and on the source, side by side.

Usage: python tools/walk_bench.py SOURCE MOUNT [--read] [--json PATH]

For each pass (cold: kernel caches dropped first, when root; then warm: the same walk again) it
times, on SOURCE and on MOUNT alternately:
- walk: a recursive os.scandir of the whole tree with a stat of every entry (what
  torchvision's ImageFolder and most loaders do at start-up);
- read (with --read): open + read + close of every file, in walk order.
It prints entries/s and the fanfs/native ratio per step and pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fanfs.bench import drop_caches


def walk(root: str) -> tuple[int, list[str]]:
    """Recursive scandir + stat of every entry; returns (entries, file paths)."""
    n = 0
    files: list[str] = []
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                e.stat(follow_symlinks=False)
                n += 1
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    files.append(e.path)
    return n, files


def read(files: list[str]) -> int:
    total = 0
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 20):
                total += len(chunk)
        finally:
            os.close(fd)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("mount")
    ap.add_argument("--read", action="store_true", help="also open+read+close every file")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    files: dict[str, list[str]] = {}  # from each root's timed walk; the read step reuses them
    for temp in ("cold", "warm"):
        for step in ("walk", "read") if args.read else ("walk",):
            got = {}
            for name, root in (("native", args.source), ("fanfs", args.mount)):
                if temp == "cold" and not drop_caches():
                    print("walk_bench: cannot drop caches (not root)", file=sys.stderr)
                start = time.perf_counter()
                if step == "walk":
                    n, files[name] = walk(root)
                else:
                    read(files[name])
                    n = len(files[name])
                got[name] = n / (time.perf_counter() - start)
            ratio = got["fanfs"] / got["native"]
            rows.append({"temp": temp, "step": step, **got, "ratio": ratio})
            print(f"{temp:4} {step:4}: native {got['native']:9.0f}/s  fanfs {got['fanfs']:9.0f}/s"
                  f"  fanfs/native {ratio:.2f}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
