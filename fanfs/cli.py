"""`fanfs <subcommand>`: argument parsing, logging set-up and the error-to-exit-code edge.

Options come from the command line, then `FANFS_*` environment variables, then defaults. A
`FanfsError` prints one line (`fanfs: error: ...`) and exits with its documented code; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fanfs import logs, mounts
from fanfs.errors import ExitCode, FanfsError, MountpointError, UsageError, WaitTimeout

log = logging.getLogger("fanfs")

POLL_S = 0.1  # wait/umount poll interval: fast enough for tests, idle enough for 512 nodes
PROBE_TIMEOUT_S = 2.0  # a daemon that cannot answer a getxattr in 2 s is treated as hung


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"FANFS_{name}", default)


# -- subcommands -----------------------------------------------------------------------------


def cmd_prepare(args: argparse.Namespace) -> int:
    from fanfs.codec import parse_compress
    from fanfs.prepare import main_summary, prepare

    try:
        parse_compress(args.compress)  # a bad value is a usage error, found before any work
    except ValueError as e:
        raise UsageError(str(e)) from None
    summary = prepare(
        Path(args.src),
        Path(args.image),
        partitions=args.partitions,
        compress=args.compress,
        jobs=args.jobs,
        force=args.force,
        broadcast=args.broadcast,
        mode=args.mode,
    )
    if summary is not None:  # None: a rank other than 0, which only helped
        main_summary(summary, Path(args.image))
    return ExitCode.OK


def cmd_info(args: argparse.Namespace) -> int:
    from fanfs.image import format_info, info
    from fanfs.progress import parse_size

    capacity = None
    if args.local_capacity is not None:
        try:
            capacity = parse_size(args.local_capacity)
        except ValueError:
            capacity = 0
        if capacity <= 0:
            raise UsageError(f"--local-capacity: not a size: {args.local_capacity!r} (e.g. 60G)")
    d = info(Path(args.image), capacity, args.replicas)
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    from fanfs.image import verify

    bad = 0
    for line in verify(Path(args.image)):
        print(line, flush=True)
        bad += 1
    print(f"verify {args.image}: {'OK' if not bad else f'{bad} problems'}", file=sys.stderr)
    return ExitCode.FAILED if bad else ExitCode.OK


def cmd_mount(args: argparse.Namespace) -> int:
    from fanfs.daemon import Daemon, MountConfig

    cfg = MountConfig(
        image=Path(args.image).absolute(),
        mountpoint=args.mountpoint,
        local=args.local,
        keep_local=args.keep_local,
        nonempty=args.nonempty,
        cache_bytes=args.cache_mb << 20,
        prefetch_bytes=None if args.prefetch_mb is None else args.prefetch_mb << 20,
        replicas=args.replicas,
        peer_timeout=args.peer_timeout,
        linger=args.linger,
    )
    Daemon(cfg).run()
    return ExitCode.OK


def _wait_serving(mountpoint: str, deadline: float) -> dict[str, Any]:
    while True:
        entry = mounts.find(mountpoint)
        if entry is not None and entry.fstype == mounts.FSTYPE:
            status = mounts.probe_status(
                mountpoint, max(0.1, min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
            )
            if status is not None and status.get("serving"):
                return status
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{mountpoint}: not serving after waiting")
        time.sleep(POLL_S)


def cmd_plan(args: argparse.Namespace) -> int:
    from fanfs import plan

    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(args.file).read_bytes()
        except OSError as e:
            raise FanfsError(f"{args.file}: cannot read: {e.strerror}") from None
    paths = [os.fsdecode(line) for line in data.split(b"\n") if line.strip()]
    taken = plan.publish(args.mountpoint, paths, args.share)
    missing = f" ({taken.missing} paths name no file under the mount)" if taken.missing else ""
    print(f"planned {taken.planned} files for share {args.share}{missing}")
    return ExitCode.OK


def cmd_wait(args: argparse.Namespace) -> int:
    _wait_serving(args.mountpoint, time.monotonic() + args.timeout)
    return ExitCode.OK


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return True


def _lazy_unmount(mountpoint: str) -> None:
    """Detach the mount now (readers still inside keep what they hold); raise if that failed."""
    try:
        done = subprocess.run(
            ["fusermount3", "-u", "-z", mountpoint], capture_output=True, text=True, timeout=10,
            check=False,
        )  # fmt: skip
        why = done.stderr.strip() or f"fusermount3 exited with {done.returncode}"
        failed = done.returncode != 0
    except (OSError, subprocess.TimeoutExpired) as e:
        why, failed = str(e), True
    if failed and mounts.find(mountpoint) is not None:
        raise MountpointError(f"{mountpoint}: lazy unmount failed: {why}")


def _abort(entry: mounts.MountEntry) -> None:
    if not mounts.abort_connection(entry):
        log.warning(
            "%s: cannot abort its FUSE connection (is fusectl mounted at %s?): readers inside "
            "may wait until its daemon ends", entry.mountpoint, mounts.FUSECTL,
        )  # fmt: skip


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = mounts.canonical(args.mountpoint)
    entry = mounts.find(mountpoint)
    if entry is None or entry.fstype != mounts.FSTYPE:
        raise MountpointError(f"{mountpoint}: no fanfs mount there")
    status = mounts.probe_status(mountpoint, PROBE_TIMEOUT_S)
    if status is None:
        # The daemon is dead or hung: take the mount away from under it, and free the readers
        # that wait on it (a lazy unmount alone leaves them waiting for a hung daemon).
        log.warning("%s: daemon not answering, aborting its connection, lazy unmount", mountpoint)
        _abort(entry)
        _lazy_unmount(mountpoint)
        return ExitCode.OK
    pid = int(status["pid"])
    os.kill(pid, signal.SIGTERM)  # the daemon unmounts and removes its staged copies
    deadline = time.monotonic() + args.timeout
    while not _exited(pid):
        if time.monotonic() >= deadline:
            _abort(entry)
            _lazy_unmount(mountpoint)
            raise WaitTimeout(f"{mountpoint}: daemon {pid} did not exit within {args.timeout} s")
        time.sleep(POLL_S)
    if mounts.find(mountpoint) is not None:
        _lazy_unmount(mountpoint)
    return ExitCode.OK


def cmd_bench(args: argparse.Namespace) -> int:
    from fanfs import bench
    from fanfs.progress import parse_size

    if args.calibrate:
        from fanfs.bench import calibrate

        cal = calibrate.calibrate(Path(args.workdir).absolute() / "calibrate",
                                  log=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
        Path(args.calibrate).write_text(json.dumps(cal.to_json(), indent=2) + "\n")
        print(_calibration_text(cal))
        print(f"bench: wrote {args.calibrate}")
        return ExitCode.OK
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        readers = [int(n) for n in args.readers.split(",")]
        temps = args.temps.split(",")
        total = parse_size(args.total)
    except ValueError as e:
        raise UsageError(f"bench: bad option value: {e}") from None
    if args.epoch == "global" and args.ranks < 2:
        raise UsageError("bench: --epoch global needs --ranks 2 or more")
    if not set(temps) <= {"cold", "warm"} or min(readers) < 1 or min(sizes) < 1:
        raise UsageError("bench: --temps takes cold,warm; sizes and readers must be positive")
    workdir = Path(args.workdir).absolute()
    rows = bench.run(workdir, sizes, total, args.min_files, readers, args.repeat, args.ranks,
                     temps, log=lambda m: print(m, file=sys.stderr, flush=True),
                     client=args.client, epoch=args.epoch, planned=args.plan)  # fmt: skip
    print(bench.format_table(rows))
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": os.uname().nodename,
              "cpus": os.cpu_count(), "argv": sys.argv[1:],
              "caches_dropped": all(r["caches_dropped"] for r in rows), "rows": rows}  # fmt: skip
    Path(args.json).write_text(json.dumps(report, indent=2))
    plotted = bench.plot(rows, Path(args.plot))
    print(
        f"bench: wrote {args.json}"
        + (f" and {args.plot}" if plotted else " (no matplotlib: no plot)")
    )
    return ExitCode.OK


def _calibration_text(cal: Any) -> str:
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


def cmd_project(args: argparse.Namespace) -> int:
    from fanfs import projection
    from fanfs.progress import parse_size

    try:
        raw = json.loads(Path(args.calibration).read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        cal = projection.Calibration.from_json(raw)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"project: cannot read calibration {args.calibration}: {e}") from None
    if args.validate:
        from fanfs.bench import calibrate

        try:
            daemons = [int(n) for n in args.daemons.split(",")]
        except ValueError:
            raise UsageError(f"project: bad --daemons {args.daemons!r}") from None
        checks = calibrate.validate(
            cal, Path(args.workdir).absolute() / "validate", daemons,
            log=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
        print(f"{'daemons':>7} {'shuffle':7} {'measured s':>10} {'model s':>8} {'error':>6}  bound")
        for v in checks:
            print(f"{v['daemons']:>7} {v['shuffle']:7} {v['measured_s']:10.2f} "
                  f"{v['projected_s']:8.2f} {v['error']:+6.0%}  {v['bound']}")  # fmt: skip
        if args.json:
            Path(args.json).write_text(
                json.dumps({"calibration": cal.to_json(), "validation": checks}, indent=2) + "\n"
            )
        return ExitCode.OK
    try:
        qs = [float(x) for x in args.q.split(",")]
        if args.image:
            from fanfs import catalog as cat

            c, _ = cat.Catalog.load(Path(args.image))
            files = int(c.is_file.sum())
            nbytes = int(c.size[c.is_file].sum())
            stored = int(c.stored_len[c.is_file].sum())
            ratios = [nbytes / max(1, stored)]
        else:
            if args.files is None or args.bytes is None:
                raise UsageError("project: give --image IMAGE, or --files N and --bytes SIZE")
            files, nbytes = args.files, parse_size(args.bytes)
            ratios = [1.0]
        if args.ratio:
            ratios = [float(x) for x in args.ratio.split(",")]
        nodes = tuple(int(n) for n in args.nodes.split(","))
        link = parse_size(args.link) if args.link else None
        pfs = parse_size(args.pfs) if args.pfs else None
    except ValueError as e:
        raise UsageError(f"project: bad option value: {e}") from None
    if min(nodes) < 1 or not all(0 <= q <= 1 for q in qs) or min(ratios) < 1:
        raise UsageError("project: nodes at least 1, --q from 0 to 1, --ratio at least 1")
    curves, report = {}, []
    for ratio in ratios:
        for q in qs:
            job = projection.Job(files=files, bytes=nbytes, readers=args.readers,
                                 replicas=args.replicas, q=q, ratio=ratio, cold=not args.warm,
                                 cores=args.cores, link_bytes_per_s=link,
                                 net_alpha_s=args.net_alpha_us * 1e-6, pfs_bytes_per_s=pfs,
                                 overhead_s=args.overhead,
                                 compute_files_per_s=args.compute)  # fmt: skip
            rows = projection.project(cal, job, nodes)
            stop, why = projection.stops_scaling(rows)
            print(_projection_text(job, rows, stop, why, cal.host))
            curves[f"q={q:g}, ratio {ratio:g}"] = rows
            report.append({"job": dataclasses.asdict(job), "rows": [r.to_json() for r in rows],
                           "stops_at": stop, "stops_because": why})  # fmt: skip
    if args.json:
        out = {"calibration": cal.to_json(), "projections": report}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        projection_plot(curves, Path(args.plot))
    return ExitCode.OK


def _projection_text(job: Any, rows: list[Any], stop: int | None, why: str, host: str) -> str:
    lines = [
        f"job: {job.files} files, {job.bytes / 1e9:.1f} GB (ratio {job.ratio:.2f}), {job.readers} "
        f"readers per node, q={job.q:g}, replicas {job.replicas}; calibration of {host}",
        f"{'nodes':>6} {'remote':>6} {'epoch s':>9} {'files/s/node':>12} {'MB/s/node':>9} "
        f"{'staging s':>9} {'effic.':>6}  bound",
    ]
    for r in rows:
        lines.append(f"{r.nodes:>6} {r.remote_share:6.0%} {r.epoch_s:9.3f} "
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


def cmd_status(args: argparse.Namespace) -> int:
    entry = mounts.find(args.mountpoint)
    if entry is None or entry.fstype != mounts.FSTYPE:
        raise MountpointError(f"{args.mountpoint}: no fanfs mount there")
    status = mounts.probe_status(args.mountpoint, PROBE_TIMEOUT_S)
    if status is None:
        raise WaitTimeout(f"{args.mountpoint}: daemon not answering")
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return ExitCode.OK
    from fanfs.status import Status, render

    try:
        print(render(Status.from_json(status)))
    except ValueError as e:  # a daemon of another fanfs version
        raise FanfsError(f"{args.mountpoint}: {e} (try --json)") from None
    return ExitCode.OK


# -- parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fanfs", description="Transient distributed file system for deep-learning I/O."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="pack a dataset directory into a prepared image")
    p.add_argument("src", metavar="SRC")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument(
        "--partitions",
        type=_positive,
        metavar="P",
        help="number of partition files (default: one per 64 MiB, 16 to 1024)",
    )
    p.add_argument(
        "--compress",
        default=_env("COMPRESS", "auto"),
        metavar="auto|zstd|none[:LEVEL]",
        help="auto (default): zstd where it pays, raw for the rest (JPEG, PNG, gzip...); "
        "zstd: wherever it makes a file smaller; none: all raw. LEVEL: zstd level (3)",
    )
    p.add_argument(
        "--jobs",
        type=_positive,
        metavar="J",
        help="reader/compressor processes (default: cores, at most 8)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace IMAGE if it is an existing fanfs image"
    )
    p.add_argument(
        "--mode",
        default=_env("MODE", "auto"),
        choices=("auto", "private", "group", "public"),
        help="who may read the image: auto (default: as private as the most private source "
        "file), private (you), group (you and your group), public (every user)",
    )
    p.add_argument(
        "--broadcast",
        action="append",
        default=[],
        metavar="GLOB",
        help="files every node holds in full (e.g. 'val/**'); repeatable",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("info", help="describe a prepared image")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--local-capacity",
        metavar="SIZE",
        help="local disk per node (e.g. 60G): how many nodes the image needs, and would need raw",
    )
    p.add_argument(
        "--replicas",
        type=_positive,
        default=1,
        metavar="R",
        help="for --local-capacity (default: 1)",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", help="recompute every checksum of a prepared image")
    p.add_argument("image", metavar="IMAGE")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("mount", help="serve an image at MOUNTPOINT (foreground)")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "--local",
        default=_env("LOCAL"),
        metavar="DIR",
        help="directory in which to create the private staging directory (default: $TMPDIR)",
    )
    p.add_argument(
        "--keep-local", action="store_true", help="keep the staged copies after unmounting"
    )
    p.add_argument(
        "--nonempty", action="store_true", help="mount over a non-empty directory (hiding it)"
    )
    p.add_argument(
        "--replicas",
        type=_positive,
        default=int(_env("REPLICAS", "1") or 1),
        metavar="R",
        help="ranks holding each partition (default: 1)",
    )
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=float(_env("PEER_TIMEOUT", "5") or 5),
        metavar="S",
        help="route around a peer silent this long (default: 5)",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=float(_env("LINGER", "60") or 60),
        metavar="S",
        help="after unmounting, serve peers at most this long (default: 60)",
    )
    p.add_argument(
        "--cache-mb",
        type=_positive,
        default=int(_env("CACHE_MB", "512") or 512),
        metavar="MB",
        help="memory cache for decoded files (default: 512)",
    )
    p.add_argument(
        "--prefetch-mb",
        type=_positive,
        default=int(_env("PREFETCH_MB", "0") or 0) or None,
        metavar="MB",
        help="how far planned epochs read ahead of the job (default: a tenth of the memory "
        "available at mount, 64 MiB to 4 GiB)",
    )
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser(
        "plan",
        help="tell the daemon the order an epoch will read its files in (planned epochs)",
        description="Hand the daemon behind MOUNTPOINT an epoch's order: FILE holds one path "
        "per line (relative to MOUNTPOINT or absolute under it), '-' reads them from stdin. The "
        "daemon reads those files ahead of the job, in that order. Python jobs can use "
        "fanfs.plan.publish or fanfs.torch.PlannedSampler instead.",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--share", type=int, default=0, help="which of the node's plans (default: 0)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("wait", help="wait until MOUNTPOINT serves")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="default: 60")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("umount", help="unmount MOUNTPOINT and wait for its daemon to exit")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="default: 60")
    p.set_defaults(func=cmd_umount)

    p = sub.add_parser("bench", help="fanfs against native reads of the same files")
    p.add_argument("--sizes", default="128K,512K,2M,8M", help="file sizes (default: %(default)s)")
    p.add_argument("--total", default="256M", help="data per size (default: %(default)s)")
    p.add_argument(
        "--min-files",
        type=_positive,
        default=64,
        metavar="N",
        help="at least this many files per size (default: %(default)s)",
    )
    p.add_argument("--readers", default="1,2,4", help="reader processes (default: %(default)s)")
    p.add_argument("--temps", default="cold,warm", help="cold, warm or both (default: %(default)s)")
    p.add_argument("--repeat", type=_positive, default=3, help="repetitions (default: 3)")
    p.add_argument(
        "--client",
        choices=("raw", "python"),
        default="raw",
        help="how files are read: raw (unbuffered into one buffer, like C readers) or python "
        "(open(path, 'rb').read(), like PIL and numpy) (default: %(default)s)",
    )
    p.add_argument(
        "--ranks",
        type=_positive,
        default=1,
        metavar="N",
        help="also measure remote reads with N daemons under mpirun (default: 1, off)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="also read cold epochs planned (fanfs.plan): rows 'planned' (one daemon) and, "
        "with --epoch global, 'epoch-planned'; both sides list the directories first",
    )
    p.add_argument(
        "--epoch",
        choices=("none", "global"),
        default="none",
        help="global: also read one globally shuffled epoch on every node at once, split as "
        "DistributedSampler splits it (needs --ranks 2 or more) (default: %(default)s)",
    )
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR") or "/tmp",
                   "fanfs-bench"), help="scratch directory (default: %(default)s)")  # fmt: skip
    p.add_argument("--json", default="fanfs-bench.json", help="default: %(default)s")
    p.add_argument("--plot", default="fanfs-bench.png", help="default: %(default)s")
    p.add_argument("--calibrate", metavar="FILE",
                   help="instead: measure this node's costs for fanfs project and write them "
                   "to FILE (JSON; about two minutes)")  # fmt: skip
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("project", help="what an epoch costs at 1 to 1,024 nodes (a model fed "
                       "by fanfs bench --calibrate)")  # fmt: skip
    p.add_argument("calibration", metavar="CALIBRATION", help="JSON from fanfs bench --calibrate")
    p.add_argument("--image", help="the dataset: a prepared image (files, sizes, ratio)")
    p.add_argument("--files", type=_positive, help="the dataset: number of files")
    p.add_argument("--bytes", help="the dataset: total size (e.g. 140G)")
    p.add_argument("--ratio", help="compression ratio(s), e.g. 1,2 (default: the image's, or 1)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256,512,1024")
    p.add_argument("--readers", type=_positive, default=4, help="per node (default: 4)")
    p.add_argument("--replicas", type=_positive, default=1)
    p.add_argument("--q", default="1",
                   help="1 global shuffle (default), 0 local, between: partial; several as "
                   "0,0.1,1 give one curve each")  # fmt: skip
    p.add_argument("--warm", action="store_true", help="epochs from the page cache, not disk")
    p.add_argument("--cores", type=float, help="per node (default: the calibration's)")
    p.add_argument("--link", help="network bandwidth per node in bytes/s, e.g. 12G (default: "
                   "measured)")  # fmt: skip
    p.add_argument(
        "--net-alpha-us",
        type=float,
        default=0.0,
        help="latency the network adds to the measured round trip (default: 0)",
    )
    p.add_argument("--pfs", help="shared file system bandwidth for staging, bytes/s, all nodes")
    p.add_argument("--overhead", type=float, default=0.0,
                   help="fixed seconds of every epoch (default: 0)")  # fmt: skip
    p.add_argument(
        "--compute",
        type=float,
        metavar="FILES_PER_S",
        help="files per second a node's training consumes (default: I/O only)",
    )
    p.add_argument("--validate", action="store_true",
                   help="run real cold epochs at 1, 2 and 4 daemons, global and local, and "
                   "report the model's error")  # fmt: skip
    p.add_argument("--daemons", default="1,2,4", help="--validate at these daemon counts")
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR") or "/tmp",
                   "fanfs-project"), help="scratch directory for --validate")  # fmt: skip
    p.add_argument("--json", help="also write the projection here")
    p.add_argument("--plot", help="also draw the efficiency curve here (PNG)")
    p.set_defaults(func=cmd_project)

    p = sub.add_parser("status", help="statistics of a running mount")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(-1 if args.quiet else args.verbose)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except FanfsError as e:
        print(f"fanfs: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fanfs: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`fanfs status | head`): not an error of ours.
        # Python would complain again when flushing stdout at exit: point it at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
