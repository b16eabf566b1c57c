"""`fanfs bench`'s runs: for each kind of data (and each file size of random data), a dataset
generated, prepared and mounted (one daemon, and N under mpirun with `--ranks`), then every case
(reader counts, cold and warm, local, remote, planned, a global epoch) measured, each side in
turn: native reads of the source files, fanfs, and where asked or relevant the same files
prepared raw (compressible data), squashfs images under squashfuse_ll (`--against
squashfs`) and the source files under the FUSE floor (`--against floor`, bench/floor.py). Who
goes first rotates with the repetition."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fanfs.bench.data as data
import fanfs.bench.epoch as global_epoch
import fanfs.bench.floor as floor
import fanfs.bench.squashfs as squashfs
from fanfs.bench.budget import cpu_by_thread
from fanfs.bench.launch import Daemons, check, mounted, scratch
from fanfs.bench.passes import (
    WARM_MAX_ROUNDS,
    WARM_MIN_S,
    Case,
    Result,
    Side,
    _read_files,
    list_dirs,
    make_cold,
    measure,
    size_label,
)
from fanfs.bench.report import summarize
from fanfs.image.catalog import Catalog
from fanfs.image.codec import FRAMED_MIN
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
    kinds: Sequence[str] = ("random",),
    against: Sequence[str] = (),
) -> list[dict[str, Any]]:
    results: list[Result] = []
    extras: dict[Case, dict[str, Any]] = {}
    with scratch(workdir, "fanfs-bench") as work:
        for kind in kinds:
            for size in sizes if kind == "random" else [0]:
                name = size_label(size) if kind == "random" else kind
                got, more = _dataset_cases(work / name, kind, size, total_bytes, min_files,
                                           readers, repeat, ranks, temps, log, client, epoch,
                                           planned, against)  # fmt: skip
                results += got
                extras.update(more)
    rows = summarize(results)
    for row in rows:
        key = Case(row["size"], row["readers"], row["temp"], row["where"], row["client"],
                   row["data"])  # fmt: skip
        row.update(extras.get(key, {}))
    return rows


def _dataset_cases(
    base: Path,
    kind: str,
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
    against: Sequence[str],
) -> tuple[list[Result], dict[Case, dict[str, Any]]]:
    """Every case of one dataset, in `base` (a new directory of the run's scratch)."""
    results: list[Result] = []
    extras: dict[Case, dict[str, Any]] = {}
    base.mkdir()
    src = base / "src"
    log(f"bench: {kind} data{f' of {size_label(size)}' if kind == 'random' else ''}: "
        "generate, prepare, mount")  # fmt: skip
    rels = data.make(kind, src, size, total_bytes, min_files, seed=size or len(kind))
    mean = sum((src / r).stat().st_size for r in rels) // len(rels)
    check("-q", "prepare", src, base / "img", timeout=1800)
    raw = kind in data.COMPRESSIBLE  # also measured against the same files stored raw
    if raw:
        check("-q", "prepare", src, base / "img-raw", "--compress", "none", timeout=1800)
    images = []
    if "squashfs" in against:
        squashfs.build(src, base / "img.sqfs", compressed=raw)
        images.append(("squashfs", base / "img.sqfs"))
        if raw:
            squashfs.build(src, base / "img-raw.sqfs", compressed=False)
            images.append(("squashfs-raw", base / "img-raw.sqfs"))
    natives = [str(src / r) for r in rels]
    plan = (readers, temps, repeat, log, client)
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(serving(base / "img", base / "one", 1))
        sides = [Side("native", src, lambda: make_cold(natives)), _fanfs_side("fanfs", d)]
        if raw:
            sides.append(_fanfs_side("fanfs-raw", stack.enter_context(
                serving(base / "img-raw", base / "raw", 1))))  # fmt: skip
        for name, image in images:
            sq = stack.enter_context(squashfs.mounted(image, base / f"mnt-{name}"))
            sides.append(Side(name, sq.mountpoint, _child_cold(sq)))
        if "floor" in against:
            exe = floor.build(base.parent)  # the run's scratch: built once for every dataset
            for name, fl in stack.enter_context(floor.mounted(src, base, exe)).items():
                sides.append(Side(name, fl.mountpoint, _child_cold(fl, natives), [fl.pid()]))
        idle = global_epoch.idle_cpu_percent(sides[1].pids)
        got = _cases(mean, kind, "local", sides, rels, *plan)
        results += got
        latency, front = daemon_latency(d), daemon_front(d)
        for case in {r.case for r in got}:
            extras[case] = {**_extras(case, got, idle), "daemon_latency_ms": latency,
                            "front": front}  # fmt: skip
        if planned and "cold" in temps:
            results += _cases(mean, kind, "planned", sides[:2], rels, readers, ["cold"], repeat,
                              log, client)  # fmt: skip
    if ranks > 1:
        got, more = _remote_cases(base, mean, kind, rels, ranks, plan, epoch, planned, temps)
        results += got
        extras.update(more)
    return results, extras


def _fanfs_side(name: str, d: Daemons) -> Side:
    def budget() -> dict[str, int]:
        total: dict[str, int] = {}
        for rank in range(d.ranks):
            for k, v in d.status(rank).get("budget", {}).items():
                total[k] = total.get(k, 0) + v
        return total

    return Side(name, d.mnts[0], lambda: make_cold((), d.mnts),
                global_epoch.daemon_pids(d), budget)  # fmt: skip


def _child_cold(child: squashfs.Squash | floor.Floor, files: Sequence[str] = ()) -> Any:
    """A file system the bench mounts beside fanfs, emptied for a cold pass, and `files`
    (the source files it reads, if any) dropped as native's are."""

    def cold() -> str:
        child.cold()
        return make_cold(files)

    return cold


def _extras(case: Case, results: list[Result], idle: float) -> dict[str, Any]:
    """The fanfs daemon's CPU per file read (and while idle), and for DataLoader passes whether
    every side gave the same samples as native reads."""
    mine = [r for r in results if r.case == case]
    out: dict[str, Any] = {**_cpu(case, results), "daemon_idle_cpu_pct": idle}
    for name in ("floor", "floor-poll"):
        if floors := [r for r in mine if r.reader == name]:
            out[f"{name.replace('-', '_')}_cpu_us_per_file"] = round(
                statistics.mean(r.daemon_cpu_s / r.files * 1e6 for r in floors), 1
            )
    if case.client == "torch":
        native = [r.samples for r in mine if r.reader == "native"]
        out["identical_samples"] = all(r.samples == native[0] for r in mine)
    return out


def _cpu(case: Case, results: list[Result]) -> dict[str, float]:
    """The CPU per file read that fanfs's daemons spent in `case` (all of them: for a remote
    case, the reader's and the owners')."""
    fanfs = [r for r in results if r.case == case and r.reader == "fanfs"]
    return {"daemon_cpu_us_per_file": round(statistics.mean(r.daemon_cpu_s / r.files * 1e6
                                                            for r in fanfs), 1)}  # fmt: skip


def _remote_cases(base: Path, mean: int, kind: str, rels: list[str], ranks: int, plan: Any,
                  epoch: str, planned: bool, temps: Sequence[str],
                  ) -> tuple[list[Result], dict[Case, dict[str, Any]]]:  # fmt: skip
    """Reads through daemon 0 of N of the files other daemons own, and the global epochs."""
    results: list[Result] = []
    extras: dict[Case, dict[str, Any]] = {}
    readers, _, repeat, log, client = plan
    src = base / "src"
    catalog, _ = Catalog.load(base / "img")
    owners = place(catalog.part_size, catalog.part_flags, ranks)
    entries = {r: catalog.resolve(r.encode()) for r in rels}
    remote = [r for r, e in entries.items()
              if e is not None and 0 not in owners[int(catalog.part[e])]]  # fmt: skip
    natives = [str(src / r) for r in remote]
    with serving(base / "img", base / "many", ranks) as d:
        sides = [Side("native", src, lambda: make_cold(natives)), _fanfs_side("fanfs", d)]
        got = _cases(mean, kind, "remote", sides, remote, *plan)
        results += got
        latency, front = daemon_latency(d), daemon_front(d)
        extras.update({r.case: {"daemon_latency_ms": latency, "front": front, **_cpu(r.case, got)}
                       for r in got})  # fmt: skip
        if epoch == "global":
            part_of = [int(catalog.part[entries[r]]) for r in rels]
            got, more = _epoch_cases(mean, kind, src, d, rels, part_of, owners, *plan)
            results += got
            extras.update(more)
            if planned and "cold" in temps:
                got, more = _epoch_cases(mean, kind, src, d, rels, part_of, owners, readers,
                                         ["cold"], repeat, log, client, planned=True)  # fmt: skip
                results += got
                extras.update(more)
    return results, extras


def daemon_latency(d: Daemons) -> dict[str, list[float]]:
    """Daemon 0's latency by source of a file's bytes (p50, p99, max in ms, over its recent
    reads), as `fanfs status` shows it: local in C (the front), local through Python, from a
    peer, from the image."""
    from fanfs.status import Status, sources

    s = Status.from_json(d.status(0))
    return {name: [ms.p50, ms.p99, ms.max] for name, ms, _ in sources(s)}


def daemon_front(d: Daemons) -> str:
    """Daemon 0's front as `fanfs status` says it: the kernel's FUSE protocol, and why the
    front answers nothing when it does not (every figure then goes through Python)."""
    front = d.status(0)["front"]
    if front.get("off"):
        return f"off ({front['off']}): every request went through Python"
    return f"answering in C (kernel FUSE {front.get('protocol', '?')})"


@contextlib.contextmanager
def serving(image: Path, base: Path, ranks: int) -> Iterator[Daemons]:
    """Daemons serving `image` with their partitions staged, for the length of a with block."""
    with mounted(image, base / "mnt-{rank}", base / "local-{rank}", ranks,
                 log=base / "daemon.log", wait_s=120) as d:  # fmt: skip
        d.wait_staged(600)
        yield d


def _cases(
    size: int,
    kind: str,
    where: str,
    sides: list[Side],
    files: list[str],
    readers: Sequence[int],
    temps: Sequence[str],
    repeat: int,
    log: Any,
    client: str,
) -> list[Result]:
    """Every reader count and temperature at one place, each side in turn (the first one
    rotating with the repetition: a pass may find the machine busier, or quieter, for a reason
    of the previous one's making), `repeat` times."""
    results: list[Result] = []
    for n in readers:
        for temp in temps:
            case = Case(size, n, temp, where, client, kind)
            for i in range(repeat):
                for k in range(len(sides)):
                    side = sides[(i + k) % len(sides)]
                    results.append(measure(case, side, files, seed=i))
            log("  " + _short(results, case))
    return results


def _short(results: list[Result], case: Case) -> str:
    row = summarize([r for r in results if r.case == case])[0]
    text = (f"{case.where} {case.data} {size_label(case.size)} {case.temp} {case.readers} "
            f"readers: fanfs/native {row['ratio']:.2f} ({row['native_files_per_s']:.0f} vs "
            f"{row['fanfs_files_per_s']:.0f} files/s)")  # fmt: skip
    for key, what in (("vs_raw", "fanfs/raw"), ("vs_squashfs", "fanfs/squashfs"),
                      ("raw_vs_squashfs_raw", "raw/squashfs-raw"), ("vs_floor", "fanfs/floor"),
                      ("floor_vs_native", "floor/native"), ("floor_poll_vs_native",
                                                            "floor-poll/native")):  # fmt: skip
        if key in row:
            text += f", {what} {row[key]:.2f}"
    return text


def _epoch_cases(
    size: int,
    kind: str,
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
    natives = [str(src / r) for r in rels]
    whole = size <= FRAMED_MIN  # files stored whole: read_ahead counts files, not frames
    for n in readers:
        for temp in temps:
            case = Case(size, n, temp, "epoch-planned" if planned else "epoch", client, kind)
            cpu_per_file, remote, threads, waits, read, ahead = [], [], [], [], 0, []
            for i in range(repeat):
                split = global_epoch.shares(len(rels), d.ranks, seed=i)
                remote.append(global_epoch.remote_share(split, part_of, owners))
                sides = [("native", [src] * d.ranks), ("fanfs", d.mnts)]
                for reader, roots in sides if i % 2 == 0 else sides[::-1]:
                    groups = global_epoch.epoch_paths(roots, rels, split)
                    rounds, cold_by, budget_at = 1, "", None
                    if temp == "cold":
                        budget_at = global_epoch.budgets(d) if reader == "fanfs" else None
                        cold_by = make_cold(natives, d.mnts if reader == "fanfs" else ())
                        if planned:
                            for root in set(roots):
                                list_dirs(root)
                    else:
                        walls = global_epoch.read_groups(groups, n, client, _read_files)
                        wall = max(w for w, _, _ in walls)
                        rounds = max(1, min(WARM_MAX_ROUNDS, round(WARM_MIN_S / max(wall, 1e-3))))
                    plans = d.mnts if planned and reader == "fanfs" else None
                    # (asked before the daemons' CPU is taken: the asking is not the reads')
                    ahead_at = global_epoch.plan_counters(d) if plans and whole else {}
                    got, (by_thread, waited), cpus, budget = global_epoch.timed_groups(
                        d, pids, [g * rounds for g in groups], n, client, _read_files, plans,
                        budget_at)  # fmt: skip
                    spent = sum(by_thread.values())
                    files = [len(g) * rounds for g in groups]
                    s = global_epoch.summary(got, files)
                    results.append(Result(case, reader, s["seconds"], int(s["files"]),
                                          int(s["nbytes"]), s["p50_ms"], s["p99_ms"], None,
                                          cold_by, spent, max_ms=s["max_ms"],
                                          mean_ms=s["mean_ms"], budget=budget,
                                          cpu_by_thread=by_thread, waited_by_thread=waited,
                                          cpus_busy=cpus, tail=s["tail"]))  # fmt: skip
                    if reader == "fanfs":
                        cpu_per_file.append(spent / max(1, sum(files)) * 1e6)
                        threads.append(by_thread)
                        waits.append(waited)
                        read += sum(files)
                    if ahead_at:
                        ahead.append(global_epoch.read_ahead(
                            ahead_at, global_epoch.plan_counters(d), sum(files),
                            remote[-1] * sum(files)))  # fmt: skip
            extras[case] = {
                "remote_share": round(statistics.mean(remote), 3),
                "daemon_cpu_us_per_file": round(statistics.mean(cpu_per_file), 1),
                "daemon_idle_cpu_pct": idle,
                "nodes": d.ranks,
                # (Result.files is a node's: the rows' own sums would count a node's files)
                "cpu_by_thread_us": cpu_by_thread(threads, read),
                "waited_by_thread_us": cpu_by_thread(waits, read),
            }
            if ahead:  # (the means over the repeats)
                extras[case]["read_ahead"] = {k: round(statistics.mean(a[k] for a in ahead), 3)
                                              for k in ahead[0]}  # fmt: skip
            log("  " + _short(results, case) + f", {extras[case]['remote_share']:.0%} remote, "
                f"daemon CPU {extras[case]['daemon_cpu_us_per_file']:.0f} us/file, "
                f"idle {idle:.1f} % of a core" + _read_ahead(extras[case]))  # fmt: skip
    return results, extras


def _read_ahead(extra: dict[str, Any]) -> str:
    if "read_ahead" not in extra:
        return ""
    a = extra["read_ahead"]
    return (
        f"; read ahead {a['files']:.0f} files, READs that found nothing read ahead "
        f"{a['overtaken_per_file']:.2f} a file, fetches {a['peer_fetches_per_file']:.2f} a "
        "peer's file"
    )
