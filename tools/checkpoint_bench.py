"""A training job's checkpoint, written through `fanfs output` and to local disk, side by side.

Usage: python tools/checkpoint_bench.py [--size-mb 2048] [--repeat 3] [--workdir DIR]
                                        [--ways dd,torch.save,log,reopen,rotate]
                                        [--log-s 60] [--json PATH]

It mounts `fanfs output DEST MNT` (DEST and the local staging in WORKDIR, a fresh directory
of its own in $TMPDIR by default; only what it made is removed), then, for each way of writing
(`dd` with 1 MiB blocks, `torch.save` of one large tensor) and each repeat, alternately:
- local: the checkpoint written to a directory on the node's disk (the file system that holds
  fanfs's staging), timed from open to close;
- fanfs: the same written under the mount, timed from open to close, then the time until it is
  at DEST (complete and checked, `fanfs sync`) reported beside it.
Each file is removed before the next write (and its removal landed). It prints the MB/s of
each and the fanfs/local ratio per way (the median of the repeats), and writes them as JSON.

And what DEST pays for what a job writes (bytes landed at DEST per byte written, from `fanfs
status`), for the files that are not one big write:
- log: a log held open and appended a line every 10 ms for --log-s seconds (as
  logging.FileHandler keeps it), with how many times DEST's copy grew while it was open;
- reopen: a log opened, appended a line and closed 2,000 times (appends/s against local disk);
- rotate: a checkpoint of --size-mb/8 written to a temporary name and renamed over the last
  one (torch.save + os.replace), 5 times in a row, then synced.
Run it as the user who trains (never root's figures: ENVIRONMENT.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FANFS = [sys.executable, "-m", "fanfs.cli"]


def fanfs(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FANFS, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def write_dd(path: Path, size_mb: int) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}",
                    "status=none"], check=True, timeout=600)  # fmt: skip


def write_torch(path: Path, size_mb: int) -> None:
    import torch

    tensor = _TENSORS.setdefault(size_mb, torch.rand(size_mb << 18))  # float32: 4 bytes each
    torch.save({"model": tensor, "step": 1000}, str(path))


_TENSORS: dict[int, object] = {}
WAYS = {"dd": write_dd, "torch.save": write_torch}


def landed_bytes(mnt: Path) -> int:
    done = fanfs("status", mnt, "--json")
    return int(json.loads(done.stdout)["landing"]["landed_bytes"])


def log_open(mnt: Path, dest: Path, seconds: float) -> dict[str, object]:
    """A log held open, a line every 10 ms: DEST bytes per byte, and DEST seen growing."""
    before = landed_bytes(mnt)
    f = open(mnt / "train.log", "a", buffering=1)  # noqa: SIM115 - held open on purpose
    sizes, i, end = set(), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        f.write(f"step {i} loss {1 / (i + 1):.6f} lr 0.1 grad-norm 1.0\n")
        i += 1
        time.sleep(0.01)
        if i % 50 == 0 and (dest / "train.log").exists():
            sizes.add((dest / "train.log").stat().st_size)
    written = f.tell()
    f.close()
    sync(mnt)
    return {"seconds": seconds, "lines": i, "bytes": written,
            "dest_bytes_per_byte": round((landed_bytes(mnt) - before) / written, 3),
            "dest_grew_while_open": len(sizes)}  # fmt: skip


def reopen(mnt: Path, plain: Path, n: int = 2000) -> dict[str, object]:
    """A log opened, appended a line and closed per step: appends/s, DEST bytes per byte."""
    rates = {}
    before = landed_bytes(mnt)
    for where, d in (("local", plain), ("fanfs", mnt)):
        began = time.perf_counter()
        for i in range(n):
            with open(d / "steps.log", "a") as f:
                f.write(f"step {i} loss {1 / (i + 1):.6f}\n")
        rates[where] = n / (time.perf_counter() - began)
    size = (mnt / "steps.log").stat().st_size
    sync(mnt)
    return {
        "appends": n,
        "local_per_s": round(rates["local"]),
        "fanfs_per_s": round(rates["fanfs"]),
        "bytes": size,
        "dest_bytes_per_byte": round((landed_bytes(mnt) - before) / size, 3),
    }


def rotate(mnt: Path, size_mb: int, versions: int = 5) -> dict[str, object]:
    """torch.save-style rotation: tmp + os.replace, `versions` in a row, then synced."""
    before = landed_bytes(mnt)
    data = os.urandom(1 << 20) * size_mb
    for _ in range(versions):
        with open(mnt / "ckpt.tmp", "wb") as f:
            f.write(data)
        os.replace(mnt / "ckpt.tmp", mnt / "last.pt")
    sync(mnt)
    landed = landed_bytes(mnt) - before
    return {"versions": versions, "mb": size_mb,
            "dest_bytes_per_version": round(landed / len(data), 3)}  # fmt: skip


def timed(write: object, path: Path, size_mb: int) -> float:
    os.sync()  # the last turn's dirty pages written back first: each write starts equal
    began = time.perf_counter()
    write(path, size_mb)  # type: ignore[operator]
    return time.perf_counter() - began


def sync(mnt: Path) -> float:
    began = time.perf_counter()
    done = fanfs("sync", mnt)
    if done.returncode != 0:
        raise SystemExit(f"fanfs sync failed: {done.stderr.strip()}")
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ways", default="dd,torch.save,log,reopen,rotate")
    ap.add_argument("--log-s", type=float, default=60.0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="fanfs-ckpt-", dir=args.workdir))
    mnt, dest, local, plain = base / "mnt", base / "dest", base / "stage", base / "local"
    for d in (mnt, dest, local, plain):
        d.mkdir()
    log = open(base / "output.log", "wb")  # noqa: SIM115 - the daemon's, until the end
    daemon = subprocess.Popen([*FANFS, "output", str(dest), str(mnt), "--local", str(local)],
                              stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    results: dict[str, dict[str, object]] = {}
    try:
        if fanfs("wait", mnt, "--timeout", "30").returncode != 0:
            raise SystemExit(f"fanfs output did not start: {(base / 'output.log').read_text()}")
        for way in args.ways.split(","):
            if way in ("log", "reopen", "rotate"):
                row = (log_open(mnt, dest, args.log_s) if way == "log" else
                       reopen(mnt, plain) if way == "reopen" else
                       rotate(mnt, max(1, args.size_mb // 8)))  # fmt: skip
                results[way] = row
                print(f"{way:11s} {row}", flush=True)
                continue
            write = WAYS[way]
            local_s, fanfs_s, dest_s = [], [], []
            for i in range(args.repeat):
                order = ("local", "fanfs") if i % 2 == 0 else ("fanfs", "local")
                for where in order:
                    if where == "local":
                        local_s.append(timed(write, plain / "ckpt.pt", args.size_mb))
                        (plain / "ckpt.pt").unlink()
                    else:
                        fanfs_s.append(timed(write, mnt / "ckpt.pt", args.size_mb))
                        dest_s.append(fanfs_s[-1] + sync(mnt))
                        if (dest / "ckpt.pt").stat().st_size < args.size_mb << 20:
                            raise SystemExit("the checkpoint at DEST is short")
                        (mnt / "ckpt.pt").unlink()
                        sync(mnt)
            mb = args.size_mb * 1.048576
            row = {
                "local_mb_s": round(mb / statistics.median(local_s), 1),
                "fanfs_mb_s": round(mb / statistics.median(fanfs_s), 1),
                "ratio": round(statistics.median(local_s) / statistics.median(fanfs_s), 2),
                "ratios": [round(a / b, 2) for a, b in zip(local_s, fanfs_s, strict=True)],
                "at_dest_s": round(statistics.median(dest_s), 2),
                "local_s": [round(x, 2) for x in local_s],
                "fanfs_s": [round(x, 2) for x in fanfs_s],
            }  # fmt: skip
            results[way] = row
            print(f"{way:11s} local {row['local_mb_s']:7.1f} MB/s  fanfs {row['fanfs_mb_s']:7.1f}"
                  f" MB/s  ratio {row['ratio']:.2f} {row['ratios']}  at DEST after "
                  f"{row['at_dest_s']} s", flush=True)  # fmt: skip
    finally:
        fanfs("umount", mnt, "--timeout", "120")
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        shutil.rmtree(base, ignore_errors=True)
    report = {"size_mb": args.size_mb, "repeat": args.repeat, "uid": os.geteuid(),
              "results": results}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
