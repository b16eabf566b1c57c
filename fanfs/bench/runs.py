"""`fanfs bench`'s runs: for each file size, a dataset generated, prepared and mounted (one
daemon, and N under mpirun with `--ranks`), then every case (reader counts, cold and warm,
local, remote, planned, a global epoch) measured, native and fanfs alternating."""

from __future__ import annotations

import contextlib
import shutil
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fanfs.bench.epoch as global_epoch
from fanfs.bench.launch import Daemons, check, mounted, scratch
from fanfs.bench.passes import (
    WARM_MAX_ROUNDS,
    WARM_MIN_S,
    Case,
    Result,
    _read_files,
    drop_caches,
    list_dirs,
    make_dataset,
    measure,
    size_label,
)
from fanfs.bench.report import NOT_DROPPED, summarize
from fanfs.catalog import Catalog
from fanfs.placement import place


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
