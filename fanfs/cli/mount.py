"""`fanfs mount`, `plan`, `wait`, `umount` and `status`: a mount's life, from outside.

None of them stats the mount point (a hung daemon would hang the command): they read the
kernel's mount table (fanfs/mounts.py) and ask the daemon through its status attribute, with
a deadline. A mount point given through a symlink is the mount at its target.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fanfs import mounts, stopsignals
from fanfs.cli.options import (
    Subparsers,
    env_default,
    positive_float,
    positive_int,
    seconds,
    share,
    size,
    staging_options,
    switches,
)
from fanfs.cli.reach import PROBE_TIMEOUT_S, ask
from fanfs.errors import (
    ExitCode,
    FanfsError,
    MountpointError,
    NotLanded,
    UsageError,
    WaitTimeout,
)
from fanfs.threads import finalizing

log = logging.getLogger("fanfs")

POLL_S = 0.1  # wait/umount poll interval: fast enough for tests, idle enough for 512 nodes


def cmd_mount(args: argparse.Namespace) -> int:
    early = stopsignals.Early()  # first: the imports below take a few hundred milliseconds
    from fanfs.node.daemon import Daemon, MountConfig

    if args.keep_size is not None and not args.keep:
        raise UsageError("--keep-size (FANFS_KEEP_SIZE) needs --keep DIR (FANFS_KEEP)")
    cfg = MountConfig(
        image=Path(args.image).absolute(),
        mountpoint=args.mountpoint,
        local=args.local,
        keep_local=args.keep_local,
        keep=args.keep,
        keep_size=args.keep_size,
        nonempty=args.nonempty,
        cache_bytes=args.cache_mb << 20,
        prefetch_bytes=None if args.prefetch_mb is None else args.prefetch_mb << 20,
        replicas=args.replicas,
        peer_timeout=args.peer_timeout,
        linger=args.linger,
        switches=switches(),
    )
    Daemon(cfg, early).run()
    return ExitCode.OK


def fanfs_mount(mountpoint: str) -> mounts.MountEntry:
    """The fanfs mount at `mountpoint` (MountpointError if there is none)."""
    entry = mounts.find(mountpoint)
    if entry is None or entry.fstype not in (mounts.FSTYPE, mounts.OUTPUT_FSTYPE):
        raise MountpointError(f"{mountpoint}: no fanfs mount there")
    return entry


def _wait_serving(mountpoint: str, deadline: float) -> dict[str, Any]:
    while True:
        entry = mounts.find(mountpoint)
        if entry is not None and entry.fstype in (mounts.FSTYPE, mounts.OUTPUT_FSTYPE):
            status = ask(entry, max(0.1, min(PROBE_TIMEOUT_S, deadline - time.monotonic())))
            if status is not None and status.get("serving"):
                return status
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{mountpoint}: not serving after waiting")
        time.sleep(POLL_S)


def cmd_wait(args: argparse.Namespace) -> int:
    _wait_serving(mounts.canonical(args.mountpoint), time.monotonic() + args.timeout)
    return ExitCode.OK


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
    taken = plan.publish(args.mountpoint, paths, args.share, relative_to=args.mountpoint)
    missing = f" ({taken.missing} paths name no file under the mount)" if taken.missing else ""
    print(f"planned {taken.planned} files for share {args.share}{missing}")
    return ExitCode.OK


def cmd_drop(args: argparse.Namespace) -> int:
    from fanfs import plan

    dropped = plan.Channel(args.mountpoint).drop()
    if args.json:
        import json

        print(json.dumps(dropped, sort_keys=True))
    else:
        print(f"dropped the cached pages of {dropped.get('inodes', 0)} files and of "
              f"{dropped.get('partitions', 0)} partitions, and the daemon's caches")  # fmt: skip
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


def _who(users: list[tuple[int, str]]) -> str:
    shown = ", ".join(f"pid {pid} ({comm})" for pid, comm in users[:5])
    return shown + (f" and {len(users) - 5} more" if len(users) > 5 else "")


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = mounts.canonical(args.mountpoint)
    entry = fanfs_mount(mountpoint)
    status = ask(entry)
    if status is None:
        # The daemon is dead or hung: take the mount away from under it, and free the readers
        # that wait on it (a lazy unmount alone leaves them waiting for a hung daemon).
        log.warning("%s: daemon not answering, aborting its connection, lazy unmount", mountpoint)
        _abort(entry)
        _lazy_unmount(mountpoint)
        if entry.fstype == mounts.OUTPUT_FSTYPE:
            _land_what_it_left(entry)
        return ExitCode.OK
    pid = int(status["pid"])
    busy = mounts.users(mountpoint, skip=pid)
    if busy and not args.force:
        raise MountpointError(
            f"{mountpoint}: busy, used by {_who(busy)}: end them first, or --force to unmount "
            "anyway (they then get ENOTCONN)"
        )
    if busy:
        log.warning("%s: unmounting while %s use it: they get ENOTCONN", mountpoint, _who(busy))
    not_landed = None
    if entry.fstype == mounts.OUTPUT_FSTYPE:
        from fanfs.cli.output import drain

        try:
            drain(entry, args.timeout)  # NotLanded: the mount stays, nothing is lost
        except NotLanded as e:
            if not args.force:
                raise
            not_landed = e  # --force: unmount anyway; the daemon keeps what did not land
        status = ask(entry) or status
    os.kill(pid, signal.SIGTERM)  # the daemon unmounts and removes its staged copies
    if entry.fstype == mounts.OUTPUT_FSTYPE and args.force:
        time.sleep(POLL_S)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # a second one: no waiting for writers or DEST
    deadline = time.monotonic() + args.timeout
    while not _exited(pid):
        if finalizing(pid) and mounts.find(mountpoint) is None:
            log.info("%s: unmounted; daemon %d has finished and ends once the job's other "
                     "ranks unmount (MPI's finalize waits for them)", mountpoint, pid)  # fmt: skip
            break
        if time.monotonic() >= deadline:
            _abort(entry)
            _lazy_unmount(mountpoint)
            raise WaitTimeout(f"{mountpoint}: daemon {pid} did not exit within {args.timeout} s")
        time.sleep(POLL_S)
    if mounts.find(mountpoint) is not None:
        _lazy_unmount(mountpoint)
    if entry.fstype == mounts.OUTPUT_FSTYPE:
        from fanfs.cli.output import failed_writes

        if not_landed is not None:
            raise NotLanded(f"{not_landed}; unmounted (--force): what did not land stays in "
                            f"{status.get('staging') or 'its staging directory'} (kept.json "
                            "names each; `fanfs output --recover DEST` lands it)")  # fmt: skip
        failed_writes(entry, status)  # unmounted, but said: their close failed, DEST is older
    return ExitCode.OK


def _land_what_it_left(entry: mounts.MountEntry) -> None:
    """An output mount whose daemon is gone: land what its journal says it left (NotLanded
    naming it if that cannot be done)."""
    from fanfs.output.salvage import recover_dir

    staging = entry.source.partition(":")[2]
    if not staging:
        raise NotLanded(f"{entry.mountpoint}: its daemon did not answer: what it had not landed "
                        "is in its staging directory (fanfs-stage-*, under its --local; "
                        "`fanfs output --recover DEST` lands it)")  # fmt: skip
    if os.path.lexists(staging):
        recover_dir(Path(staging))


def cmd_status(args: argparse.Namespace) -> int:
    entry = fanfs_mount(mounts.canonical(args.mountpoint))
    status = ask(entry)
    if status is None:
        raise WaitTimeout(f"{entry.mountpoint}: daemon not answering")
    if args.json:
        import json

        print(json.dumps(status, indent=2, sort_keys=True))
        return ExitCode.OK
    if status.get("kind") == "output":
        from fanfs.cli.output import render as render_output

        print(render_output(status))
        return ExitCode.OK
    from fanfs.status import Status, render

    try:
        print(render(Status.from_json(status)))
    except ValueError as e:  # a daemon of another fanfs version
        raise FanfsError(f"{entry.mountpoint}: {e} (try --json)") from None
    return ExitCode.OK


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("mount", help="serve an image at MOUNTPOINT (foreground)")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    staging_options(p)
    kept = p.add_mutually_exclusive_group()
    kept.add_argument(
        "--keep-local", action="store_true", help="keep the staged copies after unmounting"
    )
    kept.add_argument(
        "--keep",
        metavar="DIR",
        help="stage into DIR, a directory of yours on the node's local disk that outlives the "
        "job, and leave the copies there: the next mount with DIR adopts those its image still "
        "has ({rank}, {node} expand; env FANFS_KEEP)",
    )
    p.add_argument(
        "--keep-size",
        type=size,
        metavar="SIZE",
        help="at most this much in --keep DIR, least recently used partitions evicted first "
        "(default: no limit but the disk's; env FANFS_KEEP_SIZE)",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        metavar="R",
        help="ranks holding each partition (default: 1; env FANFS_REPLICAS)",
    )
    p.add_argument("--peer-timeout", type=positive_float, metavar="S",
                   help="route around a peer silent this long (default: 5; env "
                   "FANFS_PEER_TIMEOUT)")  # fmt: skip
    p.add_argument("--linger", type=seconds, metavar="S",
                   help="after unmounting, serve peers at most this long (default: 60; env "
                   "FANFS_LINGER)")  # fmt: skip
    p.add_argument(
        "--cache-mb",
        type=positive_int,
        metavar="MB",
        help="memory cache for decoded files (default: 512; env FANFS_CACHE_MB)",
    )
    p.add_argument(
        "--prefetch-mb",
        type=positive_int,
        metavar="MB",
        help="how far planned epochs read ahead of the job (default: a tenth of the "
        "memory available at mount, 64 MiB to 4 GiB; env FANFS_PREFETCH_MB)",
    )
    env_default(p, "keep", "KEEP", str, None)
    env_default(p, "keep_size", "KEEP_SIZE", size, None)
    env_default(p, "replicas", "REPLICAS", positive_int, 1)
    env_default(p, "peer_timeout", "PEER_TIMEOUT", positive_float, 5.0)
    env_default(p, "linger", "LINGER", seconds, 60.0)
    env_default(p, "cache_mb", "CACHE_MB", positive_int, 512)
    env_default(p, "prefetch_mb", "PREFETCH_MB", positive_int, None)
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
    p.add_argument("--share", type=share, default=0, help="which of the node's plans (default: 0)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "drop",
        help="drop what is cached of MOUNTPOINT's files: the next reads are cold",
        description="Have the daemon behind MOUNTPOINT drop the kernel's cached pages of its "
        "files, its staged copies' pages and its own caches, so that the next reads are cold, "
        "as after a reboot. For measuring without root (root can also drop_caches).",
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_drop)

    p = sub.add_parser("wait", help="wait until MOUNTPOINT serves")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--timeout", type=seconds, default=60.0, metavar="S", help="default: 60")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("umount", help="unmount MOUNTPOINT and wait for its daemon to exit")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--timeout", type=seconds, default=60.0, metavar="S", help="default: 60")
    p.add_argument(
        "--force",
        action="store_true",
        help="unmount even while processes use the mount (they get ENOTCONN)",
    )
    p.set_defaults(func=cmd_umount)

    p = sub.add_parser("status", help="statistics of a running mount")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
