"""The latency budget of a fanfs read beside native's (docs/performance.md, "The latency
budget"): what the daemons' traces (`fanfs status`'s "budget", fanfs/csrc/follow.c) say a file
cost over a case's passes, stage by stage, in microseconds per file read.

A READ the front answers is cut into stages (fanfs_native.h's FANFS_STAGE_*, fanfs.status.STAGES):
taking it and handing the lead on, the job from the catalog, the cache, the disk, the check,
the decode, a peer's piece (the wait for the MPI thread), the reply into the kernel, the push
of the rest, the end. The reads the pool begins at a LOOKUP are traced the same way ("at
LOOKUP": their disk time is then the READ's wait in "cache"). A peer's piece has legs on both
daemons: queued until the MPI thread took it, away (the request out, the owner, the reply in),
the fill (check, decode, wake); on the owner, from taking the request to its read begun (a
server thread's turn), the read, and from then to the reply's send posted. What "away" holds
beyond the owner's legs is the two MPI legs together, the ask to its owner and the reply back
("MPI both ways": two nodes' clocks need not agree, so it is not split). What the file cost
beyond the daemon's stages (the reader's open and close, LOOKUP, the kernel's FUSE round trips
and copies) is "outside"."""

from __future__ import annotations

from typing import Any

from fanfs.status import LEGS as _LEGS
from fanfs.status import STAGES

KINDS = {"local": "READ, local", "remote": "READ, a peer's", "ahead": "at LOOKUP"}
# The legs of peers' pieces ("fetch_away", "owner_read", ...), and the leader's polling.
LEGS = {f"{who}_{leg}": f"{who} {leg}" for who, legs in _LEGS.items() for leg in legs}
LEGS["spin"] = "leader polling"


def per_file(results: list[Any]) -> dict[str, float]:
    """Microseconds per file of each stage, summed over `results` (a case's fanfs passes);
    "<kind>_reads": that kind's READs per file. Empty without a budget (an older daemon)."""
    files = sum(r.files for r in results)
    total: dict[str, int] = {}
    for r in results:
        for k, v in r.budget.items():
            total[k] = total.get(k, 0) + v
    if not files or not total:
        return {}
    out: dict[str, float] = {}
    for kind in KINDS:
        if total.get(f"{kind}_n", 0) > 0:
            out[f"{kind}_reads"] = round(total[f"{kind}_n"] / files, 2)
            for stage in STAGES:
                ns = total.get(f"{kind}_{stage}_ns", 0)
                if ns > 0:
                    out[f"{kind}_{stage}"] = round(ns / files / 1e3, 1)
    for leg in LEGS:
        ns = total.get(f"{leg}_ns", 0)
        if ns > 0:
            out[leg] = round(ns / files / 1e3, 1)
    return out


def line(row: dict[str, Any], where: str) -> str:
    """One case's budget beside native's time per file."""
    b = row["budget_us"]
    parts = []
    inside = 0.0
    for kind, name in KINDS.items():
        stages = {s: b[f"{kind}_{s}"] for s in STAGES if f"{kind}_{s}" in b}
        if stages:
            parts.append(f"{name} {b[f'{kind}_reads']}/file: "
                         + " ".join(f"{s} {v:.0f}" for s, v in stages.items()))  # fmt: skip
            if kind != "ahead":  # (the pool's threads: beside the READ, not in it)
                inside += sum(stages.values())
    legs = [f"{name} {b[leg]:.0f}" for leg, name in LEGS.items() if leg in b]
    if "fetch_away" in b:  # what the owner's legs leave of it: the ask out, the reply back
        owner = sum(b.get(f"owner_{leg}", 0.0) for leg in _LEGS["owner"])
        legs.append(f"MPI both ways {max(0.0, b['fetch_away'] - owner):.0f}")
    if legs:
        parts.append("; ".join(legs))
    native, fanfs = row["native_mean_ms"] * 1e3, row["fanfs_mean_ms"] * 1e3
    return (
        f"budget {where} (us/file): native {native:.0f}, fanfs {fanfs:.0f} = "
        f"{'; '.join(parts)}; outside the daemon's READs {fanfs - inside:.0f}"
    )


def cpu_by_thread(spent: list[dict[str, float]], files: int) -> dict[str, float]:
    """The daemons' CPU (or their wait for one) per file read, in microseconds, by kind of
    thread (fanfs.bench.epoch.thread_kind), the largest first: `spent` holds each pass's
    seconds by kind, `files` the files all of them read. Empty where no daemon was watched."""
    total: dict[str, float] = {}
    for by_kind in spent:
        for kind, seconds in by_kind.items():
            total[kind] = total.get(kind, 0.0) + seconds
    if not files:
        return {}
    return {k: round(v / files * 1e6, 1)
            for k, v in sorted(total.items(), key=lambda kv: -kv[1])}  # fmt: skip


def thread_line(row: dict[str, Any], where: str) -> str:
    """Where a case's daemon CPU per file went, by kind of thread; and how long those threads
    waited for a CPU, runnable on the scheduler's queue (docs/commands.md says what that
    holds for a thread that polls)."""

    def kinds(us: dict[str, float]) -> str:
        return " ".join(f"{k} {v:.0f}" for k, v in us.items() if round(v) > 0)

    line = f"cpu {where} (us/file): " + kinds(row["cpu_by_thread_us"])
    if waited := kinds(row.get("waited_by_thread_us", {})):
        line += f"; waited for a CPU: {waited}"
    return line
