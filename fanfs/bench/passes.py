"""`fanfs bench`'s passes: one read of a set of files, by N reader processes, as a user's
loader reads them; the records of a case and its result.

A pass reads every file whole in a given order ("raw": unbuffered into one buffer, as C,
TensorFlow or DALI readers do; "python": `open(path, "rb").read()`, as PIL, numpy.load and
torch.load do), cold (the kernel caches dropped first, where permitted) or warm (the files read
again until the pass has lasted WARM_MIN_S), and reports its wall time, bytes and per-file
latencies.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fanfs import pagecache

FOLIO_SAMPLE = 16  # files whose page-cache folios are looked at after each pass
# A warm pass over 256 MiB of 128 KiB files takes 40 ms: a timer tick or a neighbour's burst
# on a shared machine moves it by a third. Warm passes therefore read the files again until
# they have taken at least this long (at most WARM_MAX_ROUNDS times).
WARM_MIN_S = 0.5
WARM_MAX_ROUNDS = 50


def size_label(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


@dataclass(frozen=True, slots=True)
class Case:
    size: int
    readers: int
    temp: str  # cold | warm
    where: str  # local | remote
    client: str = "raw"  # raw | python: how a file is read (_read_files)


@dataclass
class Result:
    case: Case
    reader: str  # native | fanfs
    seconds: float
    files: int
    nbytes: int
    p50_ms: float
    p99_ms: float
    folio_kib: float | None = None  # mean page-cache folio after the pass (root only)
    dropped: bool = True  # a cold pass began with the kernel caches dropped (root only)

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _read_files(
    paths: Sequence[str], client: str, start: Any, out: Any, plan: tuple[Path, int] | None = None
) -> None:
    """Read `paths` whole, in order. With `plan` (mount point, share), first hand the daemon
    that order (fanfs.plan, timed with the reads) and report progress as PlannedSampler does."""
    buf = bytearray(64 << 20)
    lat = []
    total = 0
    start.wait()
    t0 = time.monotonic()
    channel = None
    if plan is not None:
        from fanfs import plan as planning

        channel = planning.Channel(plan[0])
        channel.publish(paths, plan[1])
    for k, p in enumerate(paths):
        if channel is not None and k and k % planning.PROGRESS_EVERY == 0:
            channel.progress(k, plan[1])  # type: ignore[index]
        t = time.perf_counter()
        if client == "python":
            with open(p, "rb") as f:
                total += len(f.read())
        else:
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        lat.append(time.perf_counter() - t)
    out.put((t0, time.monotonic(), total, lat))


def read_all(
    paths: Sequence[str], readers: int, client: str = "raw", plan: Path | None = None
) -> tuple[float, int, list[float]]:
    """Read every path whole with `readers` processes; (wall seconds, bytes, latencies). With
    `plan` (a mount point) each process first publishes its order as its own share."""
    ctx = mp.get_context("fork")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_files, args=(paths[i::readers], client, start, out,
                                                   None if plan is None else (plan, i)))
             for i in range(readers)]  # fmt: skip
    for p in procs:
        p.start()
    start.set()
    got = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    wall = max(g[1] for g in got) - min(g[0] for g in got)
    return wall, sum(g[2] for g in got), [x for g in got for x in g[3]]


def list_dirs(root: Path) -> None:
    """List every directory under `root`, as a loader that scans its dataset first does (the
    kernel then holds every file's dentry and inode)."""
    for _ in os.walk(root):
        pass


def make_dataset(root: Path, size: int, count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    rels = []
    for i in range(count):
        rel = f"d{i % 16:02d}/f{i:06d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(size))
        rels.append(rel)
    return rels


def measure(case: Case, reader: str, root: Path, rels: list[str], seed: int) -> Result:
    """One pass. Case "planned": cold, the directories listed after the caches were dropped
    (both sides), and fanfs's readers publish their order before reading."""
    order = rels[:]
    random.Random(seed).shuffle(order)
    paths = [str(root / r) for r in order]
    rounds = 1
    dropped = True
    planned = case.where == "planned"
    if case.temp == "cold":
        dropped = drop_caches()
        if planned:
            list_dirs(root)
    else:
        wall, _, _ = read_all(paths, case.readers, case.client)  # warm up what is measured
        rounds = max(1, min(WARM_MAX_ROUNDS, round(WARM_MIN_S / max(wall, 1e-3))))
    plan = root if planned and reader == "fanfs" else None
    wall, nbytes, lat = read_all(paths * rounds, case.readers, case.client, plan)
    p50, p99 = np.percentile(np.array(lat) * 1e3, [50, 99])
    folio = pagecache.folio_kib(paths[:FOLIO_SAMPLE])
    return Result(case, reader, wall, len(paths) * rounds, nbytes, float(p50), float(p99), folio,
                  dropped)  # fmt: skip
