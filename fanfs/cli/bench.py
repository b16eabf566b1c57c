"""`fanfs bench` and `fanfs project`: measuring fanfs against native reads, and the scaling
model fed by those measurements. Every value is checked, and every output file is checked to
be writable, before any work starts: a run can take an hour.

As for every command, `--json` means: the output on stdout is JSON instead of text. Files are
written where `--report` (JSON) and `--plot` (PNG) say."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from fanfs import stopsignals
from fanfs.cli.options import (
    Subparsers,
    choice,
    fraction,
    listed,
    positive_float,
    positive_int,
    ratio,
    seconds,
    size,
    writable,
)
from fanfs.errors import ExitCode, UsageError


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _default_workdir() -> str:
    return os.environ.get("TMPDIR") or "/tmp"


def cmd_bench(args: argparse.Namespace) -> int:
    from fanfs import bench
    from fanfs.bench import machine

    workdir = Path(args.workdir).absolute()
    if args.calibrate:
        from fanfs.bench import calibrate
        from fanfs.cli.report import calibration_text

        writable(args.calibrate, "--calibrate")
        cal = calibrate.calibrate(workdir, log=_log)
        Path(args.calibrate).write_text(json.dumps(cal.to_json(), indent=2) + "\n")
        print(calibration_text(cal))
        print(f"bench: wrote {args.calibrate}")
        return ExitCode.OK
    if args.epoch == "global" and args.ranks < 2:
        raise UsageError("bench: --epoch global needs --ranks 2 or more")
    if args.client == "torch" and args.data != ["jpeg"]:
        raise UsageError("bench: --client torch decodes images: use it with --data jpeg")
    if args.client == "torch" and (args.ranks > 1 or args.plan):
        raise UsageError("bench: --client torch measures local reads only (no --ranks, --plan)")
    if args.client == "torch" and not _importable("torch", "PIL"):
        raise UsageError("bench: --client torch needs torch and Pillow (pip install -e '.[test]')")
    if "squashfs" in args.against:
        from fanfs.bench import squashfs

        if not squashfs.available():
            raise UsageError("bench: --against squashfs needs mksquashfs and squashfuse_ll "
                             "(Debian: apt-get install squashfs-tools squashfuse)")  # fmt: skip
    if "floor" in args.against:
        from fanfs.bench import floor

        if not floor.available():
            raise UsageError("bench: --against floor builds a C file system: it needs a C "
                             "compiler, pkg-config and libfuse3's headers (Debian: apt-get "
                             "install gcc pkg-config libfuse3-dev)")  # fmt: skip
    writable(args.report, "--report")
    writable(args.plot, "--plot")
    _take_stop_signals()
    wake_cpu, wake = machine.wake_cpu_us()
    _log(f"bench: a {machine.WAKE_NAP_S * 1e6:.0f} us sleep of a thread costs this machine "
         f"{wake_cpu:.1f} us of CPU (it took {wake:.0f} us): each look of a thread that polls "
         "by napping pays that")  # fmt: skip
    rows = bench.run(workdir, args.sizes, args.total, args.min_files, args.readers, args.repeat,
                     args.ranks, args.temps, log=_log, client=args.client, epoch=args.epoch,
                     planned=args.plan, kinds=args.data, against=args.against)  # fmt: skip
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": os.uname().nodename,
              "cpus": os.cpu_count(), "argv": sys.argv[1:], "uid": os.geteuid(),
              "wake_cpu_us": round(wake_cpu, 2),
              "cold_by": sorted({c for r in rows for c in r["cold_by"]}), "rows": rows}  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else bench.format_table(rows))
    Path(args.report).write_text(json.dumps(report, indent=2))
    plotted = bench.plot(rows, Path(args.plot))
    _log(f"bench: wrote {args.report}"
         + (f" and {args.plot}" if plotted else " (no matplotlib: no plot)"))  # fmt: skip
    return ExitCode.OK


def _take_stop_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP stop the bench as Ctrl-C does (a KeyboardInterrupt: what it
    mounted is unmounted on the way out), once: more of them during that clean-up do nothing.
    One its parent made it ignore (nohup) stays ignored; in the bench's reader processes,
    forked with these handlers, a stop signal does what it does by default."""
    bench = os.getpid()
    taken = [s for s in stopsignals.STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]

    def stop(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != bench:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for s in taken:  # (not SIG_IGN: processes it starts while cleaning up would keep that)
            signal.signal(s, lambda *_: None)
        raise KeyboardInterrupt

    for s in taken:
        signal.signal(s, stop)


def _importable(*names: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in names)


def _calibration(path: str) -> Any:
    from fanfs.bench import projection

    try:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return projection.Calibration.from_json(raw)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"project: cannot read calibration {path}: {e}") from None


def cmd_project(args: argparse.Namespace) -> int:
    from fanfs.bench import projection
    from fanfs.cli.report import projection_plot, projection_text, validation_text

    writable(args.report, "--report")
    writable(args.plot, "--plot")
    cal = _calibration(args.calibration)
    if args.validate:
        from fanfs.bench import calibrate

        checks = calibrate.validate(cal, Path(args.workdir).absolute(), args.daemons, log=_log)
        out = {"calibration": cal.to_json(), "validation": checks}
        print(json.dumps(out, indent=2) if args.json else validation_text(checks))
        if args.report:
            Path(args.report).write_text(json.dumps(out, indent=2) + "\n")
        return ExitCode.OK
    if args.image:
        from fanfs.image import catalog as cat

        c, _ = cat.Catalog.load(Path(args.image))
        files = int(c.is_file.sum())
        nbytes = int(c.size[c.is_file].sum())
        stored = int(c.stored_len[c.is_file].sum())
        ratios = [max(1.0, nbytes / max(1, stored))]
        if not files or not nbytes:
            raise UsageError(f"project: {args.image} holds no data to read")
    else:
        if args.files is None or args.bytes is None:
            raise UsageError("project: give --image IMAGE, or --files N and --bytes SIZE")
        files, nbytes = args.files, args.bytes
        ratios = [1.0]
    if args.ratio:
        ratios = args.ratio
    if max(args.nodes) > files:
        raise UsageError(f"project: {max(args.nodes)} nodes for {files} files: each node needs "
                         "one file at least")  # fmt: skip
    curves, report = {}, []
    for r in ratios:
        for q in args.q:
            job = projection.Job(files=files, bytes=nbytes, readers=args.readers,
                                 replicas=args.replicas, q=q, ratio=r, cold=not args.warm,
                                 cores=args.cores, link_bytes_per_s=args.link,
                                 net_alpha_s=args.net_alpha_us * 1e-6, pfs_bytes_per_s=args.pfs,
                                 overhead_s=args.overhead,
                                 compute_files_per_s=args.compute)  # fmt: skip
            rows = projection.project(cal, job, tuple(args.nodes))
            stop, why = projection.stops_scaling(rows)
            if not args.json:
                print(projection_text(job, rows, stop, why, cal.host))
            curves[f"q={q:g}, ratio {r:g}"] = rows
            report.append({"job": dataclasses.asdict(job), "rows": [x.to_json() for x in rows],
                           "stops_at": stop, "stops_because": why})  # fmt: skip
    out = {"calibration": cal.to_json(), "projections": report}
    if args.json:
        print(json.dumps(out, indent=2))
    if args.report:
        Path(args.report).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        projection_plot(curves, Path(args.plot))
    return ExitCode.OK


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("bench", help="fanfs against native reads of the same files")
    p.add_argument(
        "--sizes",
        type=listed(size),
        default="128K,512K,2M,8M",
        help="file sizes (default: %(default)s)",
    )
    p.add_argument(
        "--total", type=size, default="256M", help="data per size (default: %(default)s)"
    )
    p.add_argument(
        "--min-files",
        type=positive_int,
        default=64,
        metavar="N",
        help="at least this many files per size (default: %(default)s)",
    )
    p.add_argument(
        "--readers",
        type=listed(positive_int),
        default="1,2,4",
        help="reader processes (default: %(default)s)",
    )
    p.add_argument(
        "--temps",
        type=listed(choice("cold", "warm")),
        default="cold,warm",
        help="cold, warm or both (default: %(default)s)",
    )
    p.add_argument("--repeat", type=positive_int, default=3, help="repetitions (default: 3)")
    p.add_argument("--data", type=listed(choice("random", "arrays", "text", "jpeg")),
                   default="random",
                   help="what the files hold: random (incompressible, one dataset per size), "
                   "arrays (float32), text (CSV), jpeg (500x375 images); compressible kinds "
                   "are also measured prepared raw (default: %(default)s)")  # fmt: skip
    p.add_argument("--against", type=listed(choice("squashfs", "floor")), default=[],
                   help="also measure squashfs (a squashfs image of the same files under "
                   "squashfuse_ll, compressed where fanfs compresses; needs squashfs-tools and "
                   "squashfuse) or floor (the source files under the least a FUSE file system "
                   "does: what FUSE itself costs here; needs a C compiler and libfuse3-dev), or "
                   "both, local cases only")  # fmt: skip
    p.add_argument("--client", choices=("raw", "python", "torch"), default="raw",
                   help="how files are read: raw (unbuffered into one buffer, like C readers), "
                   "python (open(path, 'rb').read(), like PIL and numpy) or torch (a PyTorch "
                   "DataLoader decoding JPEGs, READERS workers; with --data jpeg) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--ranks",
        type=positive_int,
        default=1,
        metavar="N",
        help="also measure remote reads with N daemons under mpirun (default: 1, off)",
    )
    p.add_argument("--plan", action="store_true",
                   help="also read cold epochs planned (fanfs.plan): rows 'planned' (one daemon) "
                   "and, with --epoch global, 'epoch-planned'; both sides list the directories "
                   "first")  # fmt: skip
    p.add_argument("--epoch", choices=("none", "global"), default="none",
                   help="global: also read one globally shuffled epoch on every node at once, "
                   "split as DistributedSampler splits it (needs --ranks 2 or more) (default: "
                   "%(default)s)")  # fmt: skip
    p.add_argument("--workdir", default=_default_workdir(),
                   help="where the run makes a directory of its own for its data, removed at "
                   "the end; nothing else in it is touched (default: %(default)s)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON, not a table")
    p.add_argument(
        "--report",
        default="fanfs-bench.json",
        help="also write the report (JSON) here (default: %(default)s)",
    )
    p.add_argument("--plot", default="fanfs-bench.png", help="default: %(default)s")
    p.add_argument("--calibrate", metavar="FILE",
                   help="instead: measure this node's costs for fanfs project and write them "
                   "to FILE (JSON; about two minutes)")  # fmt: skip
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("project", help="what an epoch costs at 1 to 1,024 nodes (a model fed "
                       "by fanfs bench --calibrate)")  # fmt: skip
    p.add_argument("calibration", metavar="CALIBRATION", help="JSON from fanfs bench --calibrate")
    p.add_argument("--image", help="the dataset: a prepared image (files, sizes, ratio)")
    p.add_argument("--files", type=positive_int, help="the dataset: number of files")
    p.add_argument("--bytes", type=size, help="the dataset: total size (e.g. 140G)")
    p.add_argument(
        "--ratio",
        type=listed(ratio),
        help="compression ratio(s), e.g. 1,2 (default: the image's, or 1)",
    )
    p.add_argument(
        "--nodes", type=listed(positive_int), default="1,2,4,8,16,32,64,128,256,512,1024"
    )
    p.add_argument("--readers", type=positive_int, default=4, help="per node (default: 4)")
    p.add_argument("--replicas", type=positive_int, default=1)
    p.add_argument("--q", type=listed(fraction), default="1",
                   help="1 global shuffle (default), 0 local, between: partial; several as "
                   "0,0.1,1 give one curve each")  # fmt: skip
    p.add_argument("--warm", action="store_true", help="epochs from the page cache, not disk")
    p.add_argument("--cores", type=positive_float, help="per node (default: the calibration's)")
    p.add_argument("--link", type=size, help="network bandwidth per node in bytes/s, e.g. 12G "
                   "(default: measured)")  # fmt: skip
    p.add_argument(
        "--net-alpha-us",
        type=seconds,
        default=0.0,
        help="latency the network adds to the measured round trip (default: 0)",
    )
    p.add_argument(
        "--pfs", type=size, help="shared file system bandwidth for staging, bytes/s, all nodes"
    )
    p.add_argument(
        "--overhead", type=seconds, default=0.0, help="fixed seconds of every epoch (default: 0)"
    )
    p.add_argument(
        "--compute",
        type=positive_float,
        metavar="FILES_PER_S",
        help="files per second a node's training consumes (default: I/O only)",
    )
    p.add_argument("--validate", action="store_true",
                   help="run real cold epochs at 1, 2 and 4 daemons, global and local, and "
                   "report the model's error")  # fmt: skip
    p.add_argument(
        "--daemons",
        type=listed(positive_int),
        default="1,2,4",
        help="--validate at these daemon counts",
    )
    p.add_argument(
        "--workdir",
        default=_default_workdir(),
        help="where --validate makes a directory of its own (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON, not text")
    p.add_argument("--report", help="also write the projection (JSON) here")
    p.add_argument("--plot", help="also draw the efficiency curve here (PNG)")
    p.set_defaults(func=cmd_project)
