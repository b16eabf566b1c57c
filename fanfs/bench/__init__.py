"""`fanfs bench`: fanfs against native reads of the same files, side by side, in one run.

For each file size: generate a dataset (incompressible bytes), prepare it, mount it (staging
finished first), then for each reader count, cold (kernel caches dropped, when permitted) and
warm, read every file whole in a random order with that many reader processes, alternating
native and fanfs runs (and which of them goes first) so that drift on a shared machine hits
both alike; a warm pass reads the files as many times as it takes to last half a second. With
`--ranks N` it also mounts N daemons under mpirun and reads, through daemon 0, only the files
other daemons own (remote), against the same files read natively.

How a file is read (`--client`): "raw" opens it unbuffered and reads it into one buffer, as C,
TensorFlow or DALI readers do; "python" is `open(path, "rb").read()`, what PIL, numpy.load and
torch.load do, which on Python 3.13 and older also asks the file whether it is a terminal
(an ioctl that FUSE sends to the daemon on every open). Reports files/s, MB/s, per-file latency
percentiles and the fanfs/native ratio (median of the repetitions, with min and max), as a
table, JSON and a PNG plot.

The ratio is what matters: absolute numbers on a shared VM mean little (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import random
import shutil
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fanfs import pagecache
from fanfs.bench import epoch as global_epoch
from fanfs.bench.launch import Daemons, check, mounted, scratch
from fanfs.catalog import Catalog
from fanfs.placement import place

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


def summarize(results: list[Result]) -> list[dict[str, Any]]:
    rows = []
    cases = sorted({r.case for r in results},
                   key=lambda c: (c.where, c.size, c.temp, c.readers))  # fmt: skip
    for case in cases:
        by = {
            k: [r for r in results if r.case == case and r.reader == k] for k in ("native", "fanfs")
        }
        ratios = [
            f.files_per_s / n.files_per_s for n, f in zip(by["native"], by["fanfs"], strict=True)
        ]
        row: dict[str, Any] = {**asdict(case), "repeats": len(ratios)}
        # False: the "cold" passes could not drop the kernel caches (not root), so they read
        # whatever memory still held: a warm-cache figure, not a disk one.
        row["caches_dropped"] = all(r.dropped for rs in by.values() for r in rs)
        for k, rs in by.items():
            row[f"{k}_files_per_s"] = statistics.median(r.files_per_s for r in rs)
            row[f"{k}_mb_per_s"] = statistics.median(r.nbytes / r.seconds / 1e6 for r in rs)
            row[f"{k}_p50_ms"] = statistics.median(r.p50_ms for r in rs)
            row[f"{k}_p99_ms"] = statistics.median(r.p99_ms for r in rs)
            folios = [r.folio_kib for r in rs if r.folio_kib is not None]
            row[f"{k}_folio_kib"] = statistics.median(folios) if folios else None
        row["ratio"] = statistics.median(ratios)
        row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'where':13} {'size':>5} {'temp':4} {'rd':>2} {'native f/s':>10} {'fanfs f/s':>10} "
            f"{'nat MB/s':>8} {'fan MB/s':>8} {'nat p50/p99 ms':>15} {'fan p50/p99 ms':>15} "
            f"{'folio KiB n/f':>13} {'ratio':>5} {'(min-max)':>11}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        temp = r["temp"] + ("" if r.get("caches_dropped", True) else "*")
        lines.append(
            f"{_where(r):13} {size_label(r['size']):>5} {temp:5}{r['readers']:>2} "
            f"{r['native_files_per_s']:10.0f} {r['fanfs_files_per_s']:10.0f} "
            f"{r['native_mb_per_s']:8.0f} {r['fanfs_mb_per_s']:8.0f} "
            f"{r['native_p50_ms']:7.2f}/{r['native_p99_ms']:<7.2f} "
            f"{r['fanfs_p50_ms']:7.2f}/{r['fanfs_p99_ms']:<7.2f} "
            f"{_folios(r):>13} {r['ratio']:5.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        )
    if not all(r.get("caches_dropped", True) for r in rows):
        lines.append(NOT_DROPPED)
    return "\n".join(lines)


NOT_DROPPED = (
    "* cold: the kernel caches could not be dropped (only root may): these passes read what "
    "memory still held, so they show warm-cache speed, not the disk's; run as root for cold "
    "figures"
)


def _where(row: dict[str, Any]) -> str:
    return str(row["where"]) + ("/py" if row.get("client") == "python" else "")


def _folios(row: dict[str, Any]) -> str:
    sides = [row.get(f"{k}_folio_kib") for k in ("native", "fanfs")]
    return "/".join("?" if k is None else f"{k:.0f}" for k in sides)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # one INFO line per label
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r["where"], r["temp"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (where, temp) in zip(axes[0], groups, strict=True):
        sel = [r for r in rows if r["where"] == where and r["temp"] == temp]
        for readers in sorted({r["readers"] for r in sel}):
            pts = sorted((r["size"], r["ratio"], r["ratio_min"], r["ratio_max"])
                         for r in sel if r["readers"] == readers)  # fmt: skip
            xs = [size_label(p[0]) for p in pts]
            ys = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{readers} readers")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{where}, {temp}")
        ax.set_xlabel("file size")
        ax.set_ylabel("fanfs / native (files/s)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(
    workdir: Path,
    sizes: Sequence[int],
    total_bytes: int,
    min_files: int,
    readers: Sequence[int],
    repeat: int,
    ranks: int,
    temps: Sequence[str] = ("cold", "warm"),
    log: Any = print,
    client: str = "raw",
    epoch: str = "none",
    planned: bool = False,
) -> list[dict[str, Any]]:
    results: list[Result] = []
    extras: dict[Case, dict[str, Any]] = {}
    if "cold" in temps and not drop_caches():
        log(f"bench: {NOT_DROPPED[2:]}")
    with scratch(workdir, "fanfs-bench") as work:
        for size in sizes:
            got, more = _size_cases(work / size_label(size), size, total_bytes, min_files,
                                    readers, repeat, ranks, temps, log, client, epoch,
                                    planned)  # fmt: skip
            results += got
            extras.update(more)
    rows = summarize(results)
    for row in rows:
        row.update(extras.get(Case(row["size"], row["readers"], row["temp"], row["where"],
                                   row["client"]), {}))  # fmt: skip
    return rows


def _size_cases(
    base: Path,
    size: int,
    total_bytes: int,
    min_files: int,
    readers: Sequence[int],
    repeat: int,
    ranks: int,
    temps: Sequence[str],
    log: Any,
    client: str,
    epoch: str,
    planned: bool,
) -> tuple[list[Result], dict[Case, dict[str, Any]]]:
    """Every case at one file size, in `base` (a new directory of the run's scratch)."""
    results: list[Result] = []
    extras: dict[Case, dict[str, Any]] = {}
    count = max(min_files, total_bytes // size)
    base.mkdir()
    log(f"bench: {count} files of {size_label(size)}: generate, prepare, mount")
    rels = make_dataset(base / "src", size, count, seed=size)
    check("-q", "prepare", base / "src", base / "img", timeout=600)
    plan = (readers, temps, repeat, log, client)
    with serving(base / "img", base / "one", 1) as d:
        results += _cases(size, "local", base / "src", d.mnts[0], rels, *plan)
        if planned and "cold" in temps:
            results += _cases(size, "planned", base / "src", d.mnts[0], rels, readers,
                              ["cold"], repeat, log, client)  # fmt: skip
    if ranks > 1:
        catalog, _ = Catalog.load(base / "img")
        owners = place(catalog.part_size, catalog.part_flags, ranks)
        entries = {r: catalog.resolve(r.encode()) for r in rels}
        remote = [r for r, e in entries.items()
                  if e is not None and 0 not in owners[int(catalog.part[e])]]  # fmt: skip
        with serving(base / "img", base / "many", ranks) as d:
            results += _cases(size, "remote", base / "src", d.mnts[0], remote, *plan)
            if epoch == "global":
                part_of = [int(catalog.part[entries[r]]) for r in rels]
                got, more = _epoch_cases(size, base / "src", d, rels, part_of, owners, *plan)
                results += got
                extras.update(more)
                if planned and "cold" in temps:
                    got, more = _epoch_cases(size, base / "src", d, rels, part_of, owners,
                                             readers, ["cold"], repeat, log, client,
                                             planned=True)  # fmt: skip
                    results += got
                    extras.update(more)
    shutil.rmtree(base, ignore_errors=True)  # made here, inside the run's own scratch
    return results, extras


@contextlib.contextmanager
def serving(image: Path, base: Path, ranks: int) -> Iterator[Daemons]:
    """Daemons serving `image` with their partitions staged, for the length of a with block."""
    with mounted(image, base / "mnt-{rank}", base / "local-{rank}", ranks,
                 log=base / "daemon.log", wait_s=120) as d:  # fmt: skip
        d.wait_staged(600)
        yield d


def _cases(
    size: int,
    where: str,
    src: Path,
    mnt: Path,
    files: list[str],
    readers: Sequence[int],
    temps: Sequence[str],
    repeat: int,
    log: Any,
    client: str,
) -> list[Result]:
    """Every reader count and temperature at one size and place (local or remote), native and
    fanfs alternating, `repeat` times."""
    results: list[Result] = []
    for n in readers:
        for temp in temps:
            case = Case(size, n, temp, where, client)
            for i in range(repeat):
                # Who goes first alternates: the second pass may find the machine busier
                # (or quieter) for a reason of the first one's making.
                sides = [("native", src), ("fanfs", mnt)]
                for reader, root in sides if i % 2 == 0 else sides[::-1]:
                    results.append(measure(case, reader, root, files, seed=i))
            log("  " + _short(results, case))
    return results


def _short(results: list[Result], case: Case) -> str:
    row = summarize([r for r in results if r.case == case])[0]
    return (f"{case.where} {size_label(case.size)} {case.temp} {case.readers} readers: "
            f"fanfs/native {row['ratio']:.2f} ({row['native_files_per_s']:.0f} vs "
            f"{row['fanfs_files_per_s']:.0f} files/s)")  # fmt: skip


def _epoch_cases(
    size: int,
    src: Path,
    d: Daemons,
    rels: list[str],
    part_of: list[int],
    owners: Any,
    readers: Sequence[int],
    temps: Sequence[str],
    repeat: int,
    log: Any,
    client: str,
    planned: bool = False,
) -> tuple[list[Any], dict[Any, dict[str, Any]]]:
    """The global-epoch cases at one size (bench/global_epoch.py): Results (per-node means) and, per
    case, the remote share and the daemons' CPU per file and while idle. `planned`: cold, the
    directories listed after the caches were dropped (both sides), and every node's fanfs
    readers publish their order first (case "epoch-planned")."""
    pids = global_epoch.daemon_pids(d)
    idle = global_epoch.idle_cpu_percent(pids)
    results: list[Result] = []
    extras: dict[Case, dict[str, Any]] = {}
    for n in readers:
        for temp in temps:
            case = Case(size, n, temp, "epoch-planned" if planned else "epoch", client)
            cpu_per_file, remote = [], []
            for i in range(repeat):
                split = global_epoch.shares(len(rels), d.ranks, seed=i)
                remote.append(global_epoch.remote_share(split, part_of, owners))
                sides = [("native", [src] * d.ranks), ("fanfs", d.mnts)]
                for reader, roots in sides if i % 2 == 0 else sides[::-1]:
                    groups = global_epoch.epoch_paths(roots, rels, split)
                    rounds, dropped = 1, True
                    if temp == "cold":
                        dropped = drop_caches()
                        if planned:
                            for root in set(roots):
                                list_dirs(root)
                    else:
                        walls = global_epoch.read_groups(groups, n, client, _read_files)
                        wall = max(w for w, _, _ in walls)
                        rounds = max(1, min(WARM_MAX_ROUNDS, round(WARM_MIN_S / max(wall, 1e-3))))
                    before = global_epoch.cpu_seconds(pids)
                    plans = d.mnts if planned and reader == "fanfs" else None
                    got = global_epoch.read_groups(
                        [g * rounds for g in groups], n, client, _read_files, plans
                    )
                    spent = global_epoch.cpu_seconds(pids) - before
                    files = [len(g) * rounds for g in groups]
                    s = global_epoch.summary(got, files)
                    results.append(Result(case, reader, s["seconds"], int(s["files"]),
                                          int(s["nbytes"]), s["p50_ms"], s["p99_ms"], None,
                                          dropped))  # fmt: skip
                    if reader == "fanfs":
                        cpu_per_file.append(spent / max(1, sum(files)) * 1e6)
            extras[case] = {
                "remote_share": round(statistics.mean(remote), 3),
                "daemon_cpu_us_per_file": round(statistics.mean(cpu_per_file), 1),
                "daemon_idle_cpu_pct": idle,
                "nodes": d.ranks,
            }
            log("  " + _short(results, case) + f", {extras[case]['remote_share']:.0%} remote, "
                f"daemon CPU {extras[case]['daemon_cpu_us_per_file']:.0f} us/file, "
                f"idle {idle:.1f} % of a core")  # fmt: skip
    return results, extras
