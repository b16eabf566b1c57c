"""What `fanfs bench --calibrate` and `fanfs project` print and draw."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def calibration_text(cal: Any) -> str:
    return "\n".join([
        f"calibration of {cal.host} ({cal.cores} cores):",
        f"  local cold read   {cal.local_s * 1e6:8.0f} us + {cal.local_s_per_byte * 1e9:.2f} ns/B;"
        f" CPU {cal.local_cpu_s * 1e6:.0f} us + {cal.local_cpu_s_per_byte * 1e9:.2f} ns/B",
        f"  remote adds       {cal.alpha_s * 1e6:8.0f} us + {cal.beta_s_per_byte * 1e9:.2f} ns/B;"
        f" CPU {cal.remote_cpu_s * 1e6:.0f} us + {cal.remote_cpu_s_per_byte * 1e9:.2f} ns/B",
        f"  daemon loop       {cal.local_daemon_s * 1e6:8.0f} us + "
        f"{cal.local_daemon_s_per_byte * 1e9:.2f} ns/B a local file, "
        f"{cal.remote_daemon_s * 1e6:.0f} us + {cal.remote_daemon_s_per_byte * 1e9:.2f} ns/B "
        f"a remote one (both ends)",
        f"  warm read         {cal.warm_s * 1e6:8.0f} us + {cal.warm_s_per_byte * 1e9:.2f} ns/B",
        f"  decoding          {cal.decode_s_per_byte * 1e9:.2f} ns/B; disk "
        f"{cal.disk_bytes_per_s / 1e6:.0f} MB/s; staging {cal.stage_bytes_per_s / 1e6:.0f} MB/s;"
        f" FUSE round trip {cal.request_s * 1e6:.0f} us",
    ])  # fmt: skip


def validation_text(checks: list[dict[str, Any]]) -> str:
    lines = [f"{'daemons':>7} {'shuffle':7} {'measured s':>10} {'model s':>8} {'error':>6}  bound"]
    for v in checks:
        lines.append(f"{v['daemons']:>7} {v['shuffle']:7} {v['measured_s']:10.2f} "
                     f"{v['projected_s']:8.2f} {v['error']:+6.0%}  {v['bound']}")  # fmt: skip
    return "\n".join(lines)


def projection_text(job: Any, rows: list[Any], stop: int | None, why: str, host: str) -> str:
    lines = [
        f"job: {job.files} files, {job.bytes / 1e9:.1f} GB (ratio {job.ratio:.2f}), {job.readers} "
        f"readers per node, q={job.q:g}, replicas {job.replicas}; calibration of {host}",
        f"{'nodes':>6} {'remote':>6} {'epoch s':>9} {'files/s/node':>12} {'MB/s/node':>9} "
        f"{'staging s':>9} {'effic.':>6}  bound",
    ]
    for r in rows:
        lines.append(f"{r.nodes:>6} {r.remote_share:6.0%} {r.epoch_s:9.4g} "
                     f"{r.files_per_s_per_node:12.0f} {r.mb_per_s_per_node:9.0f} "
                     f"{r.staging_s:9.1f} {r.efficiency:6.0%}  {r.bound}")  # fmt: skip
    lines.append(f"stops scaling at {stop} nodes ({why})" if stop
                 else "scales to the last node count")  # fmt: skip
    return "\n".join(lines) + "\n"


def projection_plot(curves: dict[str, Any], path: Path) -> None:
    """Efficiency against node count, one line per curve (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        ax.plot([r.nodes for r in rows], [r.efficiency * 100 for r in rows], marker="o",
                label=label)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("scaling efficiency, %")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
