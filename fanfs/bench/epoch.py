"""`fanfs bench --ranks N --epoch global`: one globally shuffled epoch over N daemons.

The order is split the way PyTorch's DistributedSampler splits it: one seeded permutation of
all files, padded with its own head to a multiple of N, node r taking positions r, r + N, ...
Every node's readers read that node's share at the same time as the other nodes', through the
node's own mount (fanfs) or from the source directory (native: the same shares, from the local
disk). About (N-1)/N of a node's files live on another node. Reported per node: files/s (the
mean over nodes), fanfs/native, the share of remote files, and the daemons' CPU time per file
read and while idle. On one machine every "node" shares the same cores and disk: the figures
are a protocol's cost under contention, not a cluster's speed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.bench import machine
from fanfs.bench import readers as reader_procs
from fanfs.bench.launch import Daemons

IDLE_S = 2.0  # how long an idle daemon is watched for its CPU use, ...
QUIET_S = 3.0  # ... once mounted and unread this long (the data plane sleeps longer after 2 s)


def shares(n_files: int, world: int, seed: int) -> list[list[int]]:
    """Each node's share of one shuffled epoch, as DistributedSampler splits it."""
    order = np.random.default_rng(seed).permutation(n_files).tolist()
    order += order[: (-len(order)) % world]
    return [order[r::world] for r in range(world)]


def remote_share(split: list[list[int]], part_of: Sequence[int], owners: Any) -> float:
    """The fraction of all reads whose file is held by another node than its reader's."""
    remote = sum(1 for r, files in enumerate(split) for f in files if r not in owners[part_of[f]])
    return remote / max(1, sum(len(files) for files in split))


class _Tagged:
    """A queue end that labels what a reader process puts with its node."""

    def __init__(self, queue: Any, tag: int):
        self.queue, self.tag = queue, tag

    def put(self, item: Any) -> None:
        self.queue.put((self.tag, item))


def read_groups(
    groups: list[list[str]],
    readers: int,
    client: str,
    read_files: Any,
    plans: Sequence[Path] | None = None,
    window: machine.Window | None = None,
) -> list[tuple[float, int, list[float]]]:
    """Every group read by `readers` processes of its own running `read_files(paths, client,
    start, out, plan)`, all groups at once; per group (wall seconds, bytes, per-file latencies).
    With `plans` (group g's mount point), process i of group g publishes its order as share i;
    `window` watches the machine's CPUs while they read (readers.run)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = ctx.Barrier(len(groups) * readers + 1)  # every reader ready, then all at once
    procs = [ctx.Process(target=read_files, args=(paths[i::readers], client, start,
                                                   _Tagged(out, g),
                                                   None if plans is None else (plans[g], i)),
                         daemon=True)
             for g, paths in enumerate(groups) for i in range(readers)]  # fmt: skip
    got: dict[int, list[Any]] = {g: [] for g in range(len(groups))}
    for tag, item in reader_procs.run(procs, start, out, window):
        got[tag].append(item)
    return [(max(x[1] for x in items) - min(x[0] for x in items), sum(x[2] for x in items),
             [v for x in items for v in x[3]]) for _, items in sorted(got.items())]  # fmt: skip


def timed_groups(d: Daemons, pids: Sequence[int], groups: list[list[str]], readers: int,
                 client: str, read_files: Any, plans: Sequence[Path] | None,
                 budget_at: dict[str, int] | None
                 ) -> tuple[list[tuple[float, int, list[float]]],
                            tuple[dict[str, float], dict[str, float]], float,
                            dict[str, int]]:  # fmt: skip
    """`read_groups`, watched: (its groups' walls, bytes and latencies; the daemons' CPU
    seconds by kind of thread, and their seconds waiting for a CPU; the machine's CPUs busy on
    average while the readers read; given `budgets(d)` from before the pass (asked before its
    caches were emptied: the status is the heaviest request a daemon answers, and what it
    leaves running is not the pass's), the daemons' latency budget over the pass, else {})."""
    before, window = threads_now(pids), machine.Window()
    got = read_groups(groups, readers, client, read_files, plans, window)
    by_thread = since(before, pids)
    if budget_at is None:
        return got, by_thread, window.cpus, {}
    return got, by_thread, window.cpus, {k: v - budget_at.get(k, 0)
                                         for k, v in budgets(d).items()}  # fmt: skip


def budgets(d: Daemons) -> dict[str, int]:
    """The daemons' latency budgets (`fanfs status`'s "budget"), a daemon's on average (as a
    Result's files are a node's)."""
    total: dict[str, int] = {}
    for rank in range(d.ranks):
        for k, v in d.status(rank).get("budget", {}).items():
            total[k] = total.get(k, 0) + int(v)
    return {k: v // d.ranks for k, v in total.items()}


# Each daemon thread's kind, CPU time and time waiting for a CPU when last seen (ns, by (pid,
# thread id)): a thread that ended keeps counting what it had used, so no total ever goes down.
_THREAD_NS: dict[tuple[int, str], tuple[str, tuple[int, int]]] = {}
Threads = dict[tuple[int, str], tuple[str, tuple[int, int]]]  # a reading of them (threads_now)
ON_CPU, WAITED = 0, 1  # what `spent` sums: a thread's time on a CPU, or runnable and waiting


def thread_kind(comm: str, main: bool, process: str = "fanfs") -> str:
    """What a daemon's thread is, from its name (fanfs/threads.py, docs/threads.md): "loop"
    (the main thread, trio's), "front", "pool", "mpi", "plane", "plan", "serve", "trio"
    (trio's workers, which trio renames for each job), ...; "other" for a thread no one named
    (it has the name of its `process`)."""
    if main:
        return "loop"
    if comm.startswith("Trio thread") or " from " in comm:
        return "trio"
    if comm == process:
        return "other"
    return re.sub(r"[- ]\d+$", "", comm).removeprefix("fanfs-")


def threads_now(pids: Sequence[int]) -> Threads:
    """Each thread of the processes: its kind (thread_kind), its time on a CPU so far and its
    time runnable but waiting for a CPU (the scheduler's run queue), in nanoseconds
    (schedstat: /proc/PID/stat counts in 10 ms ticks, coarser than a pass over a few small
    files; where schedstat is missing, that, as the process's thread "all", and no wait). A
    thread's time since it was last seen is lost when it ends (a daemon's own threads live as
    long as it does)."""
    for pid in pids:
        if not os.path.exists(f"/proc/{pid}/schedstat"):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])
            _THREAD_NS[pid, "all"] = ("all", (ticks * 10**9 // os.sysconf("SC_CLK_TCK"), 0))
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            process = f.read().strip()
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended: gone
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    on_cpu, waited = (int(v) for v in f.read().split()[:2])
                with open(f"/proc/{pid}/task/{task}/comm") as f:
                    kind = thread_kind(f.read().strip(), int(task) == pid, process)
                _THREAD_NS[pid, task] = (kind, (on_cpu, waited))
    return {k: v for k, v in _THREAD_NS.items() if k[0] in pids}


def spent(before: Threads, after: Threads, what: int = ON_CPU) -> dict[tuple[int, str], float]:
    """CPU seconds each process's threads spent between two readings (`what`: WAITED, the
    seconds they waited for a CPU), by (pid, kind): each thread's own time, counted as the kind
    it has at the later reading (a renamed thread's past is not counted again)."""
    out: dict[tuple[int, str], float] = {}
    for key, (kind, now) in after.items():
        took = now[what] - before.get(key, (kind, (0, 0)))[1][what]
        if took > 0:
            out[key[0], kind] = out.get((key[0], kind), 0.0) + took / 1e9
    return out


def since(before: Threads, pids: Sequence[int]) -> tuple[dict[str, float], dict[str, float]]:
    """The processes' threads' CPU seconds since the reading `before`, and their seconds
    waiting for a CPU, each by kind of thread (`by_kind`)."""
    after = threads_now(pids)
    return by_kind(spent(before, after)), by_kind(spent(before, after, WAITED))


def by_kind(seconds: dict[tuple[int, str], float]) -> dict[str, float]:
    """`spent`'s seconds summed over the processes, by kind of thread."""
    out: dict[str, float] = {}
    for (_, kind), took in seconds.items():
        out[kind] = out.get(kind, 0.0) + took
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time the processes' threads have used so far."""
    return sum(ns[ON_CPU] for _, ns in threads_now(pids).values()) / 1e9


def idle_cpu_percent(pids: Sequence[int], seconds: float = IDLE_S) -> float:
    """Mean CPU use of one daemon, mounted and not read from, in percent of one core."""
    time.sleep(QUIET_S)
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return round((cpu_seconds(pids) - before) / seconds / len(pids) * 100, 2)


# What the daemons say of a planned pass's read-ahead (`fanfs status`: its part, its counter):
# the files read ahead, the READs that found nothing read ahead, and the peers' files fetched
# (alone, or in the MPI thread's batches where the data plane does not fetch them).
PLAN_COUNTERS = (("plan", "prefetched"), ("plan", "misses"), ("reader", "remote_fetches"),
                 ("reader", "batched_files"))  # fmt: skip


def plan_counters(d: Daemons) -> dict[str, int]:
    """PLAN_COUNTERS, summed over the daemons."""
    total = dict.fromkeys((key for _, key in PLAN_COUNTERS), 0)
    for rank in range(d.ranks):
        status = d.status(rank)
        for part, key in PLAN_COUNTERS:
            total[key] += int(status[part][key])
    return total


def read_ahead(before: dict[str, int], after: dict[str, int], files: int,
               peer_files: float) -> dict[str, float]:  # fmt: skip
    """How a planned pass of `files` reads (`peer_files` of them of peers' files) kept ahead:
    files read ahead; READs that found nothing read ahead, per file read (the job overtook the
    read-ahead: each such READ fetched its bytes itself); and fetches of peers' files per
    peer's file read (over 1: a READ and the read-ahead both fetched one). For files stored
    whole: a framed file's READs and fetches are its frames'."""
    moved = {k: after[k] - before[k] for k in after}
    fetched = moved["remote_fetches"] + moved["batched_files"]
    return {
        "files": moved["prefetched"],
        "overtaken_per_file": round(moved["misses"] / max(1, files), 3),
        "peer_fetches_per_file": round(fetched / max(1.0, peer_files), 3),
    }


def daemon_pids(d: Daemons) -> list[int]:
    return [int(d.status(r)["pid"]) for r in range(d.ranks)]


def summary(per_node: list[tuple[float, int, list[float]]], files: list[int]) -> dict[str, float]:
    """Mean per-node wall, files and bytes, and the latency percentiles of all reads."""
    lat = np.array([v for _, _, ls in per_node for v in ls]) * 1e3
    p50, p99 = np.percentile(lat, [50, 99]) if len(lat) else (0.0, 0.0)
    return {
        "max_ms": float(lat.max()) if len(lat) else 0.0,
        "mean_ms": float(lat.mean()) if len(lat) else 0.0,
        "tail": machine.tail_share(lat.tolist()),
        "seconds": statistics.mean(w for w, _, _ in per_node),
        "files": statistics.mean(files),
        "nbytes": statistics.mean(b for _, b, _ in per_node),
        "p50_ms": float(p50),
        "p99_ms": float(p99),
    }


def epoch_paths(roots: Sequence[Path], rels: list[str], split: list[list[int]]) -> list[list[str]]:
    return [[str(roots[r] / rels[k]) for k in files] for r, files in enumerate(split)]
