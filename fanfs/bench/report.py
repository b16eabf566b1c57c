"""`fanfs bench`'s report: a row per case (median ratio of fanfs to native, with min and max),
as a table, as JSON rows and as a PNG plot."""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fanfs.bench import budget, machine
from fanfs.bench.passes import COLD_BY, Result, size_label

# Ratios between sides reported beside fanfs/native, when both sides were measured.
VERSUS = {
    "vs_squashfs": ("fanfs", "squashfs"),
    "vs_raw": ("fanfs", "fanfs-raw"),
    "raw_vs_squashfs_raw": ("fanfs-raw", "squashfs-raw"),
    "vs_floor": ("fanfs", "floor"),
    "floor_vs_native": ("floor", "native"),
    "floor_poll_vs_native": ("floor-poll", "native"),
}


def summarize(results: list[Result]) -> list[dict[str, Any]]:
    rows = []
    cases = sorted({r.case for r in results},
                   key=lambda c: (c.data, c.where, c.size, c.temp, c.readers))  # fmt: skip
    for case in cases:
        mine = [r for r in results if r.case == case]
        by = {k: [r for r in mine if r.reader == k] for k in dict.fromkeys(r.reader for r in mine)}
        ratios = _ratios(by, "fanfs", "native")
        row: dict[str, Any] = {**asdict(case), "repeats": len(ratios)}
        row["cold_by"] = sorted({r.cold_by for r in mine if r.cold_by})
        row["caches_dropped"] = row["cold_by"] == ["drop_caches"] or case.temp == "warm"
        for k, rs in by.items():
            key = k.replace("-", "_")
            row[f"{key}_files_per_s"] = statistics.median(r.files_per_s for r in rs)
            row[f"{key}_mb_per_s"] = statistics.median(r.nbytes / r.seconds / 1e6 for r in rs)
            row[f"{key}_p50_ms"] = statistics.median(r.p50_ms for r in rs)
            row[f"{key}_p99_ms"] = statistics.median(r.p99_ms for r in rs)
            row[f"{key}_max_ms"] = max(r.max_ms for r in rs)
            folios = [r.folio_kib for r in rs if r.folio_kib is not None]
            row[f"{key}_folio_kib"] = statistics.median(folios) if folios else None
        for k, rs in by.items():
            row[f"{k.replace('-', '_')}_mean_ms"] = statistics.mean(r.mean_ms for r in rs)
            row[f"{k.replace('-', '_')}_cpus_busy"] = statistics.median(r.cpus_busy for r in rs)
            row[f"{k.replace('-', '_')}_tail"] = statistics.median(r.tail for r in rs)
        if case.temp == "cold" and (spent := budget.per_file(by.get("fanfs", []))):
            row["budget_us"] = spent
        fanfs = by.get("fanfs", [])
        read = sum(r.files for r in fanfs)
        if threads := budget.cpu_by_thread([r.cpu_by_thread for r in fanfs], read):
            row["cpu_by_thread_us"] = threads
            row["waited_by_thread_us"] = budget.cpu_by_thread([r.waited_by_thread for r in fanfs],
                                                              read)  # fmt: skip
        row["ratio"] = statistics.median(ratios)
        row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
        bounds = [machine.cpu_bound(x, f.cpus_busy, os.cpu_count() or 1)
                  for x, f in zip(ratios, by["fanfs"], strict=True)]  # fmt: skip
        if known := [b for b in bounds if b is not None]:
            row["fanfs_cpu_bound"] = statistics.median(known)
        for name, (a, b) in VERSUS.items():
            if a in by and b in by:
                row[name] = statistics.median(_ratios(by, a, b))
        rows.append(row)
    return rows


def _ratios(by: dict[str, list[Result]], a: str, b: str) -> list[float]:
    """Side a's speed over side b's, repetition by repetition."""
    return [x.files_per_s / y.files_per_s for x, y in zip(by[a], by[b], strict=True)]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'where':13} {'data':6} {'size':>5} {'temp':4} {'rd':>2} {'native f/s':>10} "
            f"{'fanfs f/s':>10} {'nat p50/p99 ms':>15} {'fan p50/p99 ms':>15} {'ratio':>5} "
            f"{'(min-max)':>11} {'vs sqfs':>7} {'vs raw':>6} {'us/file':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        extra = [f"{r[k]:7.2f}" if k in r else f"{'':7}" for k in ("vs_squashfs",)]
        extra += [f"{r[k]:6.2f}" if k in r else f"{'':6}" for k in ("vs_raw",)]
        cpu = r.get("daemon_cpu_us_per_file")
        lines.append(
            f"{_where(r):13} {r.get('data', 'random'):6} {size_label(r['size']):>5} "
            f"{r['temp']:5}{r['readers']:>2} "
            f"{r['native_files_per_s']:10.0f} {r['fanfs_files_per_s']:10.0f} "
            f"{r['native_p50_ms']:7.2f}/{r['native_p99_ms']:<7.2f} "
            f"{r['fanfs_p50_ms']:7.2f}/{r['fanfs_p99_ms']:<7.2f} "
            f"{r['ratio']:5.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) {' '.join(extra)} "
            + (f"{cpu:7.0f}" if cpu is not None else "")
        )
    how = sorted({c for r in rows for c in r.get("cold_by", [])})
    lines += [f"cold: {COLD_BY[c]}" for c in how if c in COLD_BY]
    if any(r.get("identical_samples") is False for r in rows):
        lines.append("!! a DataLoader pass gave other samples than native reads")
    seen = set()
    for r in rows:
        lat = r.get("daemon_latency_ms")
        key = (r.get("data"), r["size"], r["where"] == "remote")
        if lat and key not in seen:
            seen.add(key)
            lines.append(f"daemon latency ({r.get('data', 'random')} {size_label(r['size'])}"
                         f"{', remote' if key[2] else ''}): "
                         + "; ".join(f"{k} p50/p99/max {v[0]}/{v[1]}/{v[2]} ms"
                                     for k, v in lat.items()))  # fmt: skip
    lines += [budget.line(r, f"{_where(r)} {size_label(r['size'])} {r['temp']} x{r['readers']}")
              for r in rows if r.get("budget_us")]  # fmt: skip
    lines += [budget.thread_line(r, f"{_where(r)} {size_label(r['size'])} {r['temp']} "
                                    f"x{r['readers']}")
              for r in rows if r.get("cpu_by_thread_us")]  # fmt: skip
    lines += [_machine_line(r) for r in rows if "fanfs_cpus_busy" in r]
    lines += [_floor_line(r) for r in rows if "floor_vs_native" in r]
    lines += [f"front: {f}" for f in sorted({r["front"] for r in rows if r.get("front")})]
    idle = [r["daemon_idle_cpu_pct"] for r in rows if "daemon_idle_cpu_pct" in r]
    if idle:
        lines.append(f"idle daemon: {max(idle):.1f} % of a core at most; us/file: the fanfs "
                     "daemon's CPU time per file read")  # fmt: skip
    return "\n".join(lines)


def _machine_line(r: dict[str, Any]) -> str:
    """Whether a case kept the machine's CPUs busy, and how much of the readers' time its
    slowest reads took, each side; the most of native's speed the CPUs allow fanfs at the CPU
    its passes spent a file (bench/machine.py)."""
    sides = [k.removesuffix("_cpus_busy") for k in r if k.endswith("_cpus_busy")]
    bound = r.get("fanfs_cpu_bound")
    most = (f"; at the CPU it spent a file, the {os.cpu_count()} CPUs would let fanfs read at "
            f"{bound:.2f} of native at most" if bound is not None else "")  # fmt: skip
    return (
        f"machine {_where(r)} {size_label(r['size'])} {r['temp']} x{r['readers']}: CPUs "
        f"busy of {os.cpu_count()}: "
        + ", ".join(f"{k.replace('_', '-')} {r[f'{k}_cpus_busy']:.2f}" for k in sides)
        + f"; the slowest {machine.TAIL:.0%} of reads took of the readers' time: "
        + ", ".join(f"{k.replace('_', '-')} {r[f'{k}_tail']:.0%}" for k in sides)
        + most
    )


def _floor_line(r: dict[str, Any]) -> str:
    """What FUSE itself costs in a case (bench/floor.py) beside what fanfs costs: each side's
    speed over native's, p50 and its server's CPU per file."""
    parts = []
    for name in ("fanfs", "floor", "floor-poll"):
        key = name.replace("-", "_")
        ratio = r["ratio"] if name == "fanfs" else r.get(f"{key}_vs_native")
        if ratio is None:
            continue
        cpu = r.get("daemon_cpu_us_per_file" if name == "fanfs" else f"{key}_cpu_us_per_file")
        parts.append(f"{name} {ratio:.2f} (p50 {r[f'{key}_p50_ms']:.2f} ms"
                     + (f", {cpu:.0f} us CPU/file)" if cpu is not None else ")"))  # fmt: skip
    return (
        f"floor {_where(r)} {size_label(r['size'])} {r['temp']} x{r['readers']}, of "
        f"native's speed (p50 {r['native_p50_ms']:.2f} ms): " + "; ".join(parts)
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
