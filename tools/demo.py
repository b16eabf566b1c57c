"""`make demo`: what fanfs gives a training job, measured here in one run of about a minute.

On a generated sample dataset (class directories of files from 4 KiB to 2 MiB, half of each
compressible, as image datasets are), it shows the three things fanfs is for:

1. capacity: `fanfs prepare` packs the dataset, compressed where it pays, so every node's
   local disk holds more of it;
2. speed: one node reads a shuffled epoch cold through the mount, the job having handed the
   daemon its order (a planned epoch, as `fanfs.torch.PlannedSampler` does), against the same
   epoch read straight from the local disk (the source directory: the fastest a job could
   read, and more than a shared file system gives it); then the second epoch, warm;
3. nodes serving each other: two daemons (MPI ranks, here on one machine) each hold half of
   the dataset; node 0 reads every file, half of them from node 1, every byte checked;
4. the job's writes: a checkpoint written through `fanfs output` at the speed of the local
   disk, then landed, checked, on DEST (the shared file system's stand-in here).

Exit status 0 only if every byte read matched the source and nothing is left mounted.
Cold passes drop the kernel's caches, which only root may; as another user they read what
memory still holds, and the table says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fanfs import mounts
from fanfs import plan as planning
from fanfs.bench import COLD_BY, datagen, launch, list_dirs, make_cold
from fanfs.errors import FanfsError

REPEAT = 2  # cold passes per side, alternating; the median is shown


def fanfs(*args: object, timeout: float = 300) -> str:
    try:
        return launch.check(*map(str, args), timeout=timeout)
    except FanfsError as e:
        sys.exit(f"demo: {e}")


def epoch(root: Path, rels: list[str], plan: Path | None = None) -> tuple[float, dict[str, bytes]]:
    """(files/s, digests) of one pass over `rels` in order, one reader, as a loader reads: each
    file opened and read whole. With `plan` (a mount point), the order is handed to the daemon
    first and progress reported as PlannedSampler does (both counted in the time)."""
    digests = {}
    began = time.perf_counter()
    channel = planning.Channel(plan) if plan is not None else None
    if channel is not None:
        channel.publish(rels)
    spent_hashing = 0.0
    for k, rel in enumerate(rels):
        if channel is not None and k and k % planning.PROGRESS_EVERY == 0:
            channel.progress(k)
        with open(root / rel, "rb") as f:
            data = f.read()
        t = time.perf_counter()
        digests[rel] = hashlib.blake2b(data, digest_size=16).digest()
        spent_hashing += time.perf_counter() - t
    return len(rels) / (time.perf_counter() - began - spent_hashing), digests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the demo makes its own directory (default: $TMPDIR)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the demo's directory")
    args = ap.parse_args()
    with launch.scratch(args.workdir, "fanfs-demo", keep=args.keep) as work:
        return demo(work, args.files)


def demo(work: Path, files: int) -> int:
    t0 = time.perf_counter()
    src, image = work / "src", work / "image.fanfs"
    nbytes = datagen.sample(src, n_files=files)
    rels = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    src_files = [src / r for r in rels]
    print(f"demo: a sample dataset: {len(rels)} files, {nbytes / 1e6:.0f} MB, in {src}")

    # 1. capacity
    fanfs("-q", "prepare", src, image)
    info = json.loads(fanfs("info", image, "--json"))
    ratio = info["ratio"]
    print(f"\n1. fanfs prepare: {info['bytes'] / 1e6:.0f} MB packed into "
          f"{info['bytes_stored'] / 1e6:.0f} MB ({info['partitions']} partitions), compressed "
          f"where it pays:\n   a node's disk holds {ratio:.2f}x as much of this dataset "
          "as raw")  # fmt: skip

    # 2. speed on one node: a planned epoch, cold, then warm
    order = rels[:]
    random.Random(1).shuffle(order)
    rows: dict[str, list[float]] = {"native": [], "fanfs": []}
    digests: dict[str, dict[str, bytes]] = {}
    cold_by = set()
    ok = True
    with launch.mounted(image, work / "mnt1", work / "local1", log=work / "daemon1.log") as d:
        d.wait_staged(120)
        mnt = d.mountpoint
        for i in range(REPEAT):
            sides = [("native", src, None), ("fanfs", mnt, mnt)]
            for name, root, plan in sides if i % 2 == 0 else sides[::-1]:
                cold_by.add(make_cold(src_files, [mnt]))
                list_dirs(root)  # as a loader that scans its dataset first (ImageFolder)
                rate, digests[name] = epoch(root, order, plan)
                rows[name].append(rate)
        warm = {}
        for name, root in (("native", src), ("fanfs", mnt)):
            epoch(root, order)  # the first epoch of this side: its pages cached now
            warm[name] = epoch(root, order)[0]
        ok &= digests["fanfs"] == digests["native"]
    cold = {k: statistics.median(v) for k, v in rows.items()}
    star = "" if cold_by == {"drop_caches"} else "*"
    print("\n2. one node, one reader, a shuffled epoch (files/s):")
    print(f"   {'':34} {'native disk':>11} {'fanfs':>8} {'fanfs/native':>13}")
    print(f"   {'cold, the order handed to fanfs' + star:34} {cold['native']:11.0f} "
          f"{cold['fanfs']:8.0f} {cold['fanfs'] / cold['native']:13.2f}")  # fmt: skip
    print(f"   {'warm (the second epoch)':34} {warm['native']:11.0f} {warm['fanfs']:8.0f} "
          f"{warm['fanfs'] / warm['native']:13.2f}")  # fmt: skip
    if star:
        print("   * " + COLD_BY["fadvise"])

    # 3. two nodes serving each other
    if shutil.which("mpirun"):
        with launch.mounted(image, work / "mnt-{rank}", work / "local-{rank}", 2,
                            log=work / "daemons.log") as d:  # fmt: skip
            d.wait_staged(120)
            make_cold(src_files, d.mnts)
            list_dirs(d.mnts[0])
            rate, got = epoch(d.mnts[0], order, d.mnts[0])
            s = d.status(0)["reader"]
            ok &= got == digests["native"]
            print(f"\n3. two nodes: node 0 read all {len(order)} files cold, the order handed to "
                  f"fanfs, {s['remote_fetches'] + s['batched_files']} of them\n   from node 1 "
                  f"({s['remote_bytes'] / 1e6:.0f} MB over MPI): {rate:.0f} files/s, "
                  f"{rate / cold['native']:.2f} of the local disk's cold rate{star}; "
                  f"{s['bad_files']} bad")  # fmt: skip
    else:
        print("\n3. two nodes: skipped (no mpirun on this machine)")

    ok &= checkpoint(work)
    left = mounts.under(work)
    print(
        f"\ndemo: every byte {'matched' if ok else 'DID NOT MATCH'} the source; "
        f"{left if left else 'nothing'} left mounted; {time.perf_counter() - t0:.0f} s"
    )
    return 0 if ok and not left else 1


CHECKPOINT_MB = 512


def checkpoint(work: Path) -> bool:
    """Step 4: one checkpoint written in one write, to the local disk and through `fanfs
    output`, alternately (median of 3); then how long until it is at DEST."""
    dest, out = work / "dest", work / "out"
    dest.mkdir()
    out.mkdir()
    data = random.Random(4).randbytes(1 << 20) * CHECKPOINT_MB  # a model's weights, roughly
    with open(work / "output.log", "wb") as log:
        cmd = [*launch.FANFS, "output", dest, out, "--local", work / "local-out"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    times: dict[str, list[float]] = {"local": [], "fanfs": []}
    try:
        fanfs("wait", out, "--timeout", "30")
        for i in range(3):
            for side in ("local", "fanfs") if i % 2 == 0 else ("fanfs", "local"):
                path = (work if side == "local" else out) / "ckpt.pt"
                os.sync()
                began = time.perf_counter()
                with open(path, "wb") as f:
                    f.write(data)
                times[side].append(time.perf_counter() - began)
                if side == "fanfs":
                    fanfs("sync", out)
                    landed = time.perf_counter() - began
                    same = (dest / "ckpt.pt").read_bytes() == data
                if i < 2:
                    path.unlink()
        fanfs("umount", out)
    finally:
        launch.stop_process(proc, [out], None)
    local, through = (statistics.median(times[k]) for k in ("local", "fanfs"))
    mb = CHECKPOINT_MB * 1.048576
    exact = "exact" if same else "NOT EXACT"
    print(f"\n4. a {mb:.0f} MB checkpoint written through fanfs output: {mb / through:.0f} MB/s, "
          f"{local / through:.2f} of the local disk's\n   {mb / local:.0f} MB/s; at DEST, checked, "
          f"{landed:.1f} s after it was opened; {exact}")  # fmt: skip
    return same


if __name__ == "__main__":
    sys.exit(main())
