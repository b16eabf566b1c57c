"""`fanfs bench`'s report: a row per case (median ratio of fanfs to native, with min and max),
as a table, as JSON rows and as a PNG plot."""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fanfs.bench.passes import Result, size_label


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
