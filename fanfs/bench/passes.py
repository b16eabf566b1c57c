"""`fanfs bench`'s passes: one read of a set of files, by N reader processes, as a user's
loader reads them; the records of a case and its result.

A pass reads every file whole in a given order ("raw": unbuffered into one buffer, as C,
TensorFlow or DALI readers do; "python": `open(path, "rb").read()`, as PIL, numpy.load and
torch.load do; "torch": a PyTorch DataLoader decoding JPEGs, bench/loader.py), cold or warm
(the files read again until the pass has lasted WARM_MIN_S), and reports its wall time, bytes
and per-file latencies.

Cold, as whoever runs the bench: `make_cold` empties what a cold pass must not find. As root,
the kernel drops every cache of the machine (drop_caches). As a user (cluster users are never
root), the source files' pages are dropped with posix_fadvise(DONTNEED), and each fanfs mount's
daemon drops its files' pages, its staged copies' pages and its own caches (`fanfs drop`);
metadata (dentries, inodes) stays cached on both sides. Either way the daemon's own caches are
dropped: the kernel's drop_caches does not reach them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.bench import machine, pagecache
from fanfs.bench import readers as reader_procs

FOLIO_SAMPLE = 16  # files whose page-cache folios are looked at after each pass
# A warm pass over 256 MiB of 128 KiB files takes 40 ms: a timer tick or a neighbour's burst
# on a shared machine moves it by a third. Warm passes therefore read the files again until
# they have taken at least this long (at most WARM_MAX_ROUNDS times).
WARM_MIN_S = 0.5
WARM_MAX_ROUNDS = 50


def size_label(n: int) -> str:
    """4K, 2M: exact sizes; ~98K: a mean size."""
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"~{round(n / (1 << shift))}{unit}"
    return str(n)


@dataclass(frozen=True, slots=True)
class Case:
    size: int  # the files' size (random data), or their mean size
    readers: int
    temp: str  # cold | warm
    where: str  # local | remote | planned | epoch | epoch-planned
    client: str = "raw"  # raw | python | torch: how a file is read (_read_files, loader)
    data: str = "random"  # what the files hold (bench/data.py)


@dataclass
class Side:
    """One way to read a dataset's files, measured against the others in every case: "native"
    (the source directory), "fanfs", "fanfs-raw" (the same files prepared uncompressed),
    "squashfs", "squashfs-raw"."""

    name: str
    root: Path  # where its files are
    cold: Callable[[], str]  # empties its caches, says how (make_cold)
    pids: list[int] = field(default_factory=list)  # its daemons, for their CPU time
    # Its daemons' latency budgets summed (`fanfs status`'s "budget"), for the per-file budget.
    budget: Callable[[], dict[str, int]] | None = None


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
    cold_by: str = ""  # how a cold pass was made cold (make_cold); "" when warm
    daemon_cpu_s: float = 0.0  # CPU time its daemons spent during the pass
    samples: list[int] | None = None  # torch: each sample's CRC-32, by file name
    max_ms: float = 0.0  # the slowest file
    mean_ms: float = 0.0  # a file's mean time (open, read, close)
    budget: dict[str, int] = field(default_factory=dict)  # the daemons' budget over the pass
    # daemon_cpu_s by kind of thread (fanfs.bench.epoch.thread_kind), and the seconds they
    # waited for a CPU (runnable, on the scheduler's queue)
    cpu_by_thread: dict[str, float] = field(default_factory=dict)
    waited_by_thread: dict[str, float] = field(default_factory=dict)
    cpus_busy: float = 0.0  # the machine's CPUs busy during the pass, on average (machine.py)
    tail: float = 0.0  # the part of the readers' time its slowest reads took (machine.py)

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds


def drop_caches() -> bool:
    """Root's way: the kernel drops every clean cache of the machine. False for a user."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def evict(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Drop the page cache's pages of each file (any reader may: posix_fadvise(DONTNEED))."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.fdatasync(fd)  # dirty pages (files just generated) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_cold(files: Iterable[str | os.PathLike[str]] = (), mounts: Sequence[Path] = ()) -> str:
    """Empty what a cold pass must not find: each fanfs mount's daemon drops its caches and its
    files' pages (`fanfs drop`), then root drops the kernel's caches, or a user `files`' pages.
    How it was done: "drop_caches" or "fadvise"."""
    from fanfs import plan

    for m in mounts:
        plan.Channel(m).drop()
    if drop_caches():
        return "drop_caches"
    evict(files)
    return "fadvise"


COLD_BY = {
    "drop_caches": "cold passes began with the kernel's caches dropped (root: drop_caches) and "
    "each daemon's own (fanfs drop)",
    "fadvise": "cold passes began with the source files' pages dropped (posix_fadvise "
    "DONTNEED, as the user who ran the bench: no root) and each fanfs daemon's cached pages, "
    "staged copies' pages and own caches (fanfs drop); directory entries stay cached",
}


def _read_files(
    paths: Sequence[str], client: str, start: Any, out: Any, plan: tuple[Path, int] | None = None
) -> None:
    """Read `paths` whole, in order. With `plan` (mount point, share), first hand the daemon
    that order (fanfs.plan, timed with the reads) and report progress as PlannedSampler does.
    `start` is a barrier the process waits at once its buffer is made: zeroing 64 MiB costs a
    process tens of milliseconds of CPU, which must not overlap another reader's timed pass."""
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
    paths: Sequence[str], readers: int, client: str = "raw", plan: Path | None = None,
    window: machine.Window | None = None,
) -> tuple[float, int, list[float]]:  # fmt: skip
    """Read every path whole with `readers` processes; (wall seconds, bytes, latencies). With
    `plan` (a mount point) each process first publishes its order as its own share; `window`
    watches the machine's CPUs while they read (readers.run)."""
    ctx = mp.get_context("fork")
    start = ctx.Barrier(readers + 1)  # every reader ready, then all start at once
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_files, args=(paths[i::readers], client, start, out,
                                                   None if plan is None else (plan, i)),
                         daemon=True)
             for i in range(readers)]  # fmt: skip
    got = reader_procs.run(procs, start, out, window)
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


def measure(case: Case, side: Side, rels: list[str], seed: int) -> Result:
    """One pass of `side`'s files. Case "planned": cold, the directories listed after the
    caches were dropped (both sides), and fanfs's readers publish their order before reading."""
    from fanfs.bench.epoch import since, threads_now

    order = rels[:]
    random.Random(seed).shuffle(order)
    paths = [str(side.root / r) for r in order]
    rounds = 1
    cold_by = ""
    planned = case.where == "planned"
    # The daemons' budget before a cold pass, asked before its caches are emptied: the status
    # is the heaviest request a daemon answers, and what it leaves running must not be counted
    # as the pass's CPU.
    timed = side.budget if side.budget is not None and case.temp == "cold" else None
    budget = timed() if timed is not None else {}
    if case.temp == "cold":
        cold_by = side.cold()
        if planned:
            list_dirs(side.root)
    else:
        wall = _pass(paths, case, None)[0]  # warm up what is measured
        rounds = max(1, min(WARM_MAX_ROUNDS, round(WARM_MIN_S / max(wall, 1e-3))))
    plan = side.root if planned and side.name == "fanfs" else None
    before, window = threads_now(side.pids), machine.Window()
    window.begin()  # (begun again as the readers are let go: readers.run)
    wall, nbytes, lat, samples = _pass(paths * rounds, case, plan, window)
    window.end()
    by_thread, waited = since(before, side.pids)
    if timed is not None:
        budget = {k: v - budget.get(k, 0) for k, v in timed().items()}
    if samples is not None:  # in the order of the files' names, so that sides compare
        samples = [crc for _, crc in sorted(zip(order * rounds, samples, strict=True))]
    p50, p99 = np.percentile(np.array(lat) * 1e3, [50, 99])
    folio = pagecache.folio_kib(paths[:FOLIO_SAMPLE]) if case.client != "torch" else None
    return Result(case, side.name, wall, len(paths) * rounds, nbytes, float(p50), float(p99),
                  folio, cold_by, sum(by_thread.values()), samples, max(lat) * 1e3,
                  float(np.mean(lat)) * 1e3, budget, by_thread, waited, window.cpus,
                  machine.tail_share(lat))  # fmt: skip


def _pass(paths: list[str], case: Case, plan: Path | None, window: machine.Window | None = None
          ) -> tuple[float, int, list[float], list[int] | None]:  # fmt: skip
    if case.client == "torch":
        from fanfs.bench.loader import read_loader

        return read_loader(paths, case.readers)
    return (*read_all(paths, case.readers, case.client, plan, window), None)
