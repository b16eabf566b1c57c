"""`fanfs bench --calibrate FILE` and `fanfs project --validate`: the measured side of the model.

Calibration (fanfs.bench.projection.Calibration) on the nodes at hand, in about two minutes: two
daemons serve an image of incompressible files of two sizes; one reader on daemon 0's mount
reads the files daemon 0 holds (local) and those daemon 1 holds (remote), cold and warm, and
each cost is fitted as a + b * bytes from the two sizes. The daemon bound is the run time of
the daemons' event-loop threads per file (schedstat); the CPU bound is capacity, readers on both
daemons at once: the cores' time over the files done; both with the staged partitions in the
page cache and only the mount's pages evicted, so that the disk (a bound of its own) does not
pass for CPU. The disk's speed is native cold
reads of the large files with four readers; staging is the daemons' own; decoding is libzstd
(the library the native pool uses) on text and arrays in this process; a FUSE round trip is a
terminal check (FUSE_IOCTL) on an open file of the mount.

Validation runs real cold epochs at 1, 2 and 4 daemons, global (every node reads a
DistributedSampler share) and local (every node reads the files it holds), and compares each
node's mean epoch time with the model's. On one machine the "nodes" share its cores and disk,
so the model is told so: cores and disk bandwidth per node are the machine's over N.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.bench import (
    _read_files,
    datagen,
    drop_caches,
    make_dataset,
    projection,
    read_all,
    serving,
)
from fanfs.bench import epoch as global_epoch
from fanfs.bench.launch import check, scratch
from fanfs.image import codec
from fanfs.image.catalog import Catalog
from fanfs.placement import place

SMALL, LARGE = 64 << 10, 1 << 20
SMALL_FILES, LARGE_FILES = 768, 96
VALIDATE_FILES, VALIDATE_SIZE = 1536, 128 << 10
VALIDATE_READERS = 2  # per node
REPEAT = 5  # each measurement's median counts: this kind of machine is noisy
SATURATE = (2, 4)  # readers per daemon tried for its capacity (the best counts)


def _per_file(paths: Sequence[str], readers: int, cold: bool = False, evict: bool = False) -> float:
    """Wall seconds per file, `readers` processes reading `paths`: after all caches were
    dropped (`cold`), or after only the mount's pages were (`evict`: the daemons' disk reads
    come from the page cache), or warm."""
    walls = []
    for _ in range(REPEAT):
        if cold:
            drop_caches()
        if evict:
            _evict(paths)
        walls.append(read_all(list(paths), readers)[0])
    return statistics.median(walls) / len(paths)


# A daemon's one-of-a-kind threads (fanfs.bench.epoch.thread_kind): its event loop (the main
# thread), its MPI thread and its data plane.
SERIAL_THREADS = ("loop", "mpi", "plane")


def _loop_per_file(paths: Sequence[str], pids: Sequence[int]) -> float:
    """Seconds per file of each daemon's busiest one-of-a-kind thread (its event loop, its
    MPI thread or its data plane), summed over the daemons `pids`, while the most readers of
    SATURATE read `paths` (the mount's pages evicted): the daemon bound's demand, which a
    node's other cores cannot share. (The front answers local and peers' small files with no
    event loop; their fetches pass the data planes at both ends.)"""
    spent = 0.0
    for _ in range(REPEAT):
        _evict(paths)
        before = global_epoch.threads_now(pids)
        read_all(list(paths), SATURATE[-1])
        took = global_epoch.spent(before, global_epoch.threads_now(pids))
        for pid in pids:
            spent += max(took.get((pid, t), 0.0) for t in SERIAL_THREADS)
    return spent / (REPEAT * len(paths))


def _evict(paths: Sequence[str]) -> None:
    """Drop these files' pages from the page cache (the mount's), not the daemons' partitions."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fit(t_small: float, t_large: float) -> tuple[float, float]:
    """(a, b) of t = a + b * bytes through the two sizes (b and a at least 0)."""
    b = max(0.0, (t_large - t_small) / (LARGE - SMALL))
    return max(0.0, t_small - b * SMALL), b


def _decode_s_per_byte() -> float:
    """Seconds per decoded byte of zstd (fanfs.image.codec) on text tables."""
    rng = np.random.default_rng(0)
    text = datagen.csv_table(rng, 3000)
    codec_id, stored, _ = codec.Encoder(codec.Policy("zstd", 3)).encode(text)
    began = time.perf_counter()
    for _ in range(20):
        codec.decode(stored, codec_id, len(text), None)
    return (time.perf_counter() - began) / (20 * len(text))


def _request_s(mountpoint: Path, rel: str) -> float:
    fd = os.open(mountpoint / rel, os.O_RDONLY)
    try:
        best = math.inf
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(200):
                os.isatty(fd)
            best = min(best, (time.perf_counter() - began) / 200)
        return best
    finally:
        os.close(fd)


def calibrate(parent: Path, log: Callable[[str], None] = print) -> projection.Calibration:
    """Measure this node's costs, in a new directory of its own under `parent`."""
    with scratch(parent, "fanfs-calibrate") as workdir:
        got, cores = _measure(workdir, log)
    return _calibration(got, cores)


def _measure(workdir: Path, log: Callable[[str], None]) -> tuple[dict[str, float], int]:
    src = workdir / "src"
    sets = {size: make_dataset(src / str(size), size, count, seed=size)
            for size, count in ((SMALL, SMALL_FILES), (LARGE, LARGE_FILES))}  # fmt: skip
    rels = {size: [f"{size}/{r}" for r in got] for size, got in sets.items()}
    log("calibrate: prepare")
    check("-q", "prepare", src, workdir / "img", "--compress", "none", "--partitions", "16",
          timeout=600)  # fmt: skip
    catalog, _ = Catalog.load(workdir / "img")
    owners = place(catalog.part_size, catalog.part_flags, 2)

    def held_by(rank: int, size: int) -> list[str]:
        out = []
        for r in rels[size]:
            e = catalog.resolve(r.encode())
            if e is not None and rank in owners[int(catalog.part[e])]:
                out.append(r)
        return out

    got: dict[str, float] = {}
    cores = os.cpu_count() or 1
    with serving(workdir / "img", workdir / "m", 2) as d:
        pids = global_epoch.daemon_pids(d)
        st = d.status(0)["store"]
        stage = st["bytes_staged"] / max(st["staging_seconds"], 1e-6)
        for size in (SMALL, LARGE):
            local = [held_by(0, size), held_by(1, size)]
            log(f"calibrate: {size >> 10} KiB files, {len(local[0])} held by each daemon")
            own = [[str(d.mnts[r] / f) for f in local[r]] for r in (0, 1)]
            other = [[str(d.mnts[r] / f) for f in local[1 - r]] for r in (0, 1)]
            # Latency: one reader. The daemon bound: its event loop's run time per file (one
            # thread). The CPU bound: the best of SATURATE readers per daemon on both at once,
            # the cores' time over the files done (CPU-time accounting would count the
            # daemons' polling, which gives way to work).
            got[f"local{size}"] = _per_file(own[0], 1, cold=True)
            got[f"warm{size}"] = _per_file(own[0], 1, cold=False)
            got[f"remote{size}"] = _per_file(other[0], 1, cold=True)
            got[f"local_daemon{size}"] = _loop_per_file(own[0], pids[:1])
            got[f"local_cpu{size}"] = _both_per_file(own) * cores
            # A remote file costs its reader's daemon and the owner's: both halves, per node.
            got[f"remote_daemon{size}"] = _loop_per_file(other[0], pids)
            got[f"remote_cpu{size}"] = _both_per_file(other) * cores
        request = _request_s(d.mnts[0], rels[SMALL][0])
    drop_caches()
    wall, nbytes, _ = read_all([str(src / r) for r in rels[LARGE]], 4)
    got["disk"] = nbytes / wall
    got["request"] = request
    got["stage"] = stage
    return got, cores


def _calibration(got: dict[str, float], cores: int) -> projection.Calibration:
    def fit(key: str) -> tuple[float, float]:
        return _fit(got[f"{key}{SMALL}"], got[f"{key}{LARGE}"])

    (a_l, b_l), (a_r, b_r) = fit("local"), fit("remote")
    return projection.Calibration(
        host=os.uname().nodename,
        cores=cores,
        local_s=a_l,
        local_s_per_byte=b_l,
        local_cpu_s=fit("local_cpu")[0],
        local_cpu_s_per_byte=fit("local_cpu")[1],
        local_daemon_s=fit("local_daemon")[0],
        local_daemon_s_per_byte=fit("local_daemon")[1],
        alpha_s=max(0.0, a_r - a_l),
        beta_s_per_byte=max(0.0, b_r - b_l),
        remote_cpu_s=fit("remote_cpu")[0],
        remote_cpu_s_per_byte=fit("remote_cpu")[1],
        remote_daemon_s=fit("remote_daemon")[0],
        remote_daemon_s_per_byte=fit("remote_daemon")[1],
        warm_s=fit("warm")[0],
        warm_s_per_byte=fit("warm")[1],
        decode_s_per_byte=_decode_s_per_byte(),
        disk_bytes_per_s=got["disk"],
        stage_bytes_per_s=got["stage"],
        request_s=got["request"],
    )


def _both_per_file(groups: list[list[str]]) -> float:
    """Wall seconds per file, each group read by readers of its own, all groups at once (the
    mount's pages evicted): the best of SATURATE readers per group."""
    best = math.inf
    for n in SATURATE:
        walls = []
        for _ in range(REPEAT):
            for paths in groups:
                _evict(paths)
            got = global_epoch.read_groups(groups, n, "raw", _read_files)
            walls.append(max(w for w, _, _ in got))
        best = min(best, statistics.median(walls) / sum(len(g) for g in groups))
    return best


def _local_split(part_of: Sequence[int], owners: Any, world: int, seed: int) -> list[list[int]]:
    """Each node's files for a local-shuffle epoch (q = 0): the files it holds, shuffled,
    padded to the longest node's count as DistributedSampler pads."""
    rng = np.random.default_rng(seed)
    split = [[f for f, p in enumerate(part_of) if r in owners[p]] for r in range(world)]
    longest = max(len(s) for s in split)
    out = []
    for files in split:
        order = rng.permutation(files).tolist()
        out.append((order * (longest // max(1, len(order)) + 1))[:longest])
    return out


def validate(
    cal: projection.Calibration,
    parent: Path,
    ranks: Sequence[int] = (1, 2, 4),
    repeat: int = 3,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measured and projected cold epochs at each daemon count, global and local shuffle, in a
    new directory of its own under `parent`."""
    with scratch(parent, "fanfs-validate") as workdir:
        return _validate(cal, workdir, ranks, repeat, log)


def _validate(
    cal: projection.Calibration,
    workdir: Path,
    ranks: Sequence[int],
    repeat: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    src = workdir / "src"
    rels = make_dataset(src, VALIDATE_SIZE, VALIDATE_FILES, seed=7)
    check("-q", "prepare", src, workdir / "img", "--compress", "none", "--partitions", "32",
          timeout=600)  # fmt: skip
    catalog, _ = Catalog.load(workdir / "img")
    part_of = [int(catalog.part[catalog.resolve(r.encode())]) for r in rels]
    rows = []
    for n in ranks:
        owners = place(catalog.part_size, catalog.part_flags, n)
        with serving(workdir / "img", workdir / f"m{n}", n) as d:
            for mode, q in (("global", 1.0), ("local", 0.0)):
                walls = []
                for i in range(repeat):
                    split = (global_epoch.shares(len(rels), n, seed=i) if q
                             else _local_split(part_of, owners, n, seed=i))  # fmt: skip
                    groups = global_epoch.epoch_paths(d.mnts, rels, split)
                    drop_caches()
                    got = global_epoch.read_groups(groups, VALIDATE_READERS, "raw",
                                                   _read_files)  # fmt: skip
                    walls.append(statistics.mean(w for w, _, _ in got))
                measured = statistics.median(walls)
                files = len(split[0]) * n
                job = projection.Job(files=files, bytes=files * VALIDATE_SIZE,
                                     readers=VALIDATE_READERS, q=q, cores=cal.cores / n,
                                     disk_bytes_per_s=cal.disk_bytes_per_s / n)  # fmt: skip
                bounds = projection.epoch_bounds(cal, job, n)
                projected, bound = projection.epoch_seconds(bounds, VALIDATE_READERS)
                row = {"daemons": n, "shuffle": mode, "measured_s": measured,
                       "projected_s": projected, "bound": bound,
                       "error": (projected - measured) / measured,
                       "remote_share": projection.remote_share(job, n)}  # fmt: skip
                log(f"validate: {n} daemons, {mode}: measured {measured:.2f} s, projected "
                    f"{projected:.2f} s ({bound}), error {row['error']:+.0%}")  # fmt: skip
                rows.append(row)
    return rows
