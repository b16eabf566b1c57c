"""Jobs that come back: the same image mounted several times in a row with `--keep`, by N
daemons, against the first mount's staging from the image.

Usage: python tools/keep_bench.py IMAGE [--ranks 4] [--runs 3] [--workdir DIR] [--json PATH]

Each run is `fanfs mount IMAGE` under `mpirun -np RANKS` (one daemon per rank, each with its
own mount point and `--keep WORKDIR/keep-{rank}`), waits until every daemon is done staging,
reads nothing, unmounts. Before each run the image's partition files are dropped from the page
cache (posix_fadvise DONTNEED, which a user may do on files they can read), so the first run
reads them from the disk as a cold job reads the shared file system. It prints, per run: the
seconds until every daemon was done staging (the slowest daemon's), the partitions staged from
the image and adopted from DIR, the bytes read from the image, and the run's staging time as a
share of the first's. WORKDIR (default: a fresh directory in $TMPDIR) and what it holds are
removed at the end. Run it as the user who trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fanfs.bench import launch
from fanfs.progress import human_bytes


def evict(image: Path) -> None:
    for part in image.glob("part-*.pack"):
        fd = os.open(part, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one(image: Path, work: Path, run: int, ranks: int) -> dict[str, float]:
    base = work / f"run{run}"
    base.mkdir()
    evict(image)
    with launch.mounted(image, base / "mnt-{rank}", base / "local-{rank}", ranks,
                        ["--linger", "5", "--keep", str(work / "keep-{rank}")],
                        log=base / "mount.log") as d:  # fmt: skip
        d.wait_staged(3600)
        st = [d.status(r)["store"] for r in range(ranks)]
    return {"staging_s": max(s["staging_seconds"] for s in st),
            "staged": sum(s["partitions_staged"] for s in st),
            "adopted": sum(s["partitions_adopted"] for s in st),
            "bytes_from_image": sum(s["bytes_from_image"] for s in st)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("image", type=Path)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in args.image.glob("part-*.pack"))
    rows = []
    with launch.scratch(args.workdir, "fanfs-keep-bench") as work:
        for run in range(args.runs):
            rows.append(one(args.image, work, run, args.ranks))
    first = rows[0]["staging_s"]
    print(f"{args.image}: {human_bytes(size)}, {args.ranks} daemons, {time.strftime('%F')}")
    print(f"{'run':>3}  {'staging s':>9}  {'staged':>6}  {'adopted':>7}  {'from image':>10}  "
          f"{'of image':>8}  {'time vs run 0':>13}")  # fmt: skip
    for i, r in enumerate(rows):
        print(f"{i:>3}  {r['staging_s']:>9.3f}  {r['staged']:>6}  {r['adopted']:>7}  "
              f"{human_bytes(r['bytes_from_image']):>10}  {r['bytes_from_image'] / size:>8.1%}  "
              f"{r['staging_s'] / max(first, 1e-9):>13.4f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"image_bytes": size, "ranks": args.ranks,
                                         "runs": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
