"""`make demo`: the whole fanfs cycle on a generated sample dataset, in under two minutes.

Generates a few thousand files (4 KiB to 2 MiB, in class directories), prepares an image,
mounts it, reads every file in a random order through the mount and straight from the source
directory (cold, caches dropped when root, then warm), checks every byte against the source,
prints files/s and MB/s side by side, and unmounts. Exit status 0 only if every byte matched
and nothing is left mounted.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import time
from pathlib import Path

from fanfs import datagen, mounts
from fanfs.bench import NOT_DROPPED, drop_caches, launch
from fanfs.errors import FanfsError


def fanfs(*args: object, timeout: float = 300) -> str:
    try:
        return launch.check(*map(str, args), timeout=timeout)
    except FanfsError as e:
        sys.exit(f"demo: {e}")


def read_all(root: Path, rels: list[str]) -> tuple[float, int, dict[str, bytes]]:
    """Seconds spent reading (open, read, close; digests computed outside), bytes, digests."""
    digests = {}
    total = 0
    spent = 0.0
    for rel in rels:
        start = time.perf_counter()
        with open(root / rel, "rb") as f:
            data = f.read()
        spent += time.perf_counter() - start
        total += len(data)
        digests[rel] = hashlib.blake2b(data, digest_size=16).digest()
    return spent, total, digests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--compress", default="auto", help="auto (the default of prepare), zstd, none")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the demo makes its own directory (default: $TMPDIR)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the demo's directory")
    args = ap.parse_args()
    with launch.scratch(args.workdir, "fanfs-demo", keep=args.keep) as work:
        return demo(work, args.files, args.compress, args.keep)


def demo(work: Path, files: int, compress: str, keep: bool) -> int:
    src, image, mnt, local = work / "src", work / "image.fanfs", work / "mnt", work / "local"
    t0 = time.perf_counter()
    print(f"demo: generating {files} files in {src}", flush=True)
    nbytes = datagen.sample(src, n_files=files)
    print(f"demo: {nbytes / 1e6:.0f} MB generated in {time.perf_counter() - t0:.1f} s")
    print(fanfs("prepare", src, image, "--compress", compress).strip())
    ok = left = False
    try:
        daemon = launch.Daemons(image, mnt, local, log=work / "daemon.log")
    except FanfsError as e:
        sys.exit(f"demo: {e}")
    try:
        daemon.wait_staged(120)
        rels = [str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()]
        random.Random(0).shuffle(rels)
        rows = []
        digests: dict[str, dict[str, bytes]] = {}
        for temp in ("cold", "warm"):
            for name, root in (("native", src), ("fanfs", mnt)):
                dropped = temp == "cold" and drop_caches()
                if temp == "warm":
                    read_all(root, rels)  # warm exactly what is measured next
                secs, total, digests[name] = read_all(root, rels)
                rows.append((temp + ("" if dropped or temp == "warm" else "*"), name, secs, total))
        bad = [rel for rel in rels if digests["fanfs"][rel] != digests["native"][rel]]
        print(f"\n{'pass':6} {'reader':7} {'files/s':>9} {'MB/s':>8} {'fanfs/native':>13}")
        for i, (temp, name, secs, total) in enumerate(rows):
            ratio = f"{rows[i - 1][2] / secs:13.2f}" if name == "fanfs" else ""
            print(f"{temp:6} {name:7} {len(rels) / secs:9.0f} {total / secs / 1e6:8.0f} {ratio}")
        if any(r[0].endswith("*") for r in rows):
            print(NOT_DROPPED)
        print(f"\ndemo: {len(rels)} files checked against the source, {len(bad)} differ")
        print(fanfs("status", mnt).strip())
        ok = not bad
    except FanfsError as e:
        print(f"demo: {e}", file=sys.stderr)
    finally:
        daemon.stop()
        left = mounts.find(mnt) is not None
    print(f"demo: unmounted, {'kept' if keep else 'removing'} {work}; "
          f"total {time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
