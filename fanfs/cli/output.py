"""`fanfs output` and `fanfs sync`: a writable mount whose files land on DEST, and waiting
until they have. `fanfs umount` and `fanfs status` (cli/mount.py) serve output mounts too:
umount drains first (`drain`, here) and refuses to unmount what is not at DEST.

Like the dataset mount's commands, none of them stats the mount point: they read the kernel's
mount table and ask the daemon through its status attribute, with a deadline.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from fanfs import mounts, stopsignals
from fanfs.cli.options import (
    Subparsers,
    env_default,
    positive_float,
    positive_int,
    seconds,
    staging_options,
    switches,
)
from fanfs.cli.reach import ask
from fanfs.errors import ExitCode, MountpointError, NotLanded, UsageError, WaitTimeout

POLL_S = 0.1
# `sync` and `umount` give up on a DEST that failed this many more times in a row for the same
# op (about 0.5 + 1 s of retries after the one they ask for): the daemon keeps retrying, and a
# later sync can succeed.
GIVE_UP_ATTEMPTS = 3


def cmd_output(args: argparse.Namespace) -> int:
    early = stopsignals.Early()  # first: the imports below take a few hundred milliseconds
    from fanfs.output.daemon import OutputConfig, OutputDaemon

    if args.mountpoint is None and not args.recover:
        raise UsageError("fanfs output: MOUNTPOINT is needed (or --recover, to land only what "
                         "dead daemons left for DEST)")  # fmt: skip
    OutputDaemon(OutputConfig(
        dest=args.dest, mountpoint=args.mountpoint, local=args.local, nonempty=args.nonempty,
        replicas=args.replicas, peer_timeout=args.peer_timeout, drain=args.drain,
        interval=args.interval, switches=switches(),
    ), early).run()  # fmt: skip
    return ExitCode.OK


def output_mount(mountpoint: str) -> mounts.MountEntry:
    entry = mounts.find(mountpoint)
    if entry is None or entry.fstype != mounts.OUTPUT_FSTYPE:
        raise MountpointError(f"{mountpoint}: no fanfs output mount there")
    return entry


def _landing(entry: mounts.MountEntry, xattr: str = mounts.STATUS_XATTR) -> dict[str, Any]:
    status = ask(entry, xattr=xattr)
    if status is None:
        raise WaitTimeout(f"{entry.mountpoint}: daemon not answering")
    landing: dict[str, Any] = status["landing"]
    return landing


def drain(entry: mounts.MountEntry, timeout: float) -> dict[str, Any]:
    """Wait until everything written under the mount before this call (open files too, as
    they are) is at DEST, with what dead daemons left for it; NotLanded (naming the files) if
    DEST keeps failing or `timeout` passes first. A failing op is retried at once (and
    GIVE_UP_ATTEMPTS times more before this gives up)."""
    landing = _landing(entry, mounts.RETRY_XATTR)
    target = landing["enqueued"]
    failed_before = (landing.get("failing") or {}).get("attempts", 0)
    deadline = time.monotonic() + timeout
    while landing["landed"] < target or landing.get("recovering"):
        failing = landing.get("failing")
        gave_up = failing and failing["attempts"] >= failed_before + GIVE_UP_ATTEMPTS
        if gave_up or time.monotonic() >= deadline:
            why = f"not done within {timeout:g} s"
            if failing:
                why = (f"{failing['op']} {failing['path']} failed {failing['attempts']} times: "
                       f"{failing['error']}")  # fmt: skip
            pending = landing["pending"]
            more = landing["backlog_files"] - len(pending)
            raise NotLanded(
                f"{entry.mountpoint}: {landing['backlog_files']} files not at DEST yet ({why}); "
                "the daemon keeps trying: run this again once DEST works, or `fanfs sync "
                "--skip` to land the rest without it. Not there: "
                + (", ".join(pending) or "(renames and removals only)")
                + (f" and {more} more" if more > 0 else "")
            )
        time.sleep(POLL_S)
        landing = _landing(entry)
    return landing


def failed_writes(entry: mounts.MountEntry, status: dict[str, Any] | None) -> None:
    """NotLanded for files whose last write failed (their close said so): DEST keeps their
    last good version until they are written again."""
    failed = (status or {}).get("failed_writes") or []
    if failed:
        raise NotLanded(f"{entry.mountpoint}: files whose last write failed are not at DEST "
                        f"(it keeps their last good version): {', '.join(failed)}")  # fmt: skip


def cmd_sync(args: argparse.Namespace) -> int:
    entry = output_mount(mounts.canonical(args.mountpoint))
    if args.skip:
        failing = _landing(entry).get("failing")
        # By the op's number: a second request for the answer (getxattr asks its size first)
        # skips nothing more.
        skipped = ask(entry, xattr=f"{mounts.SKIP_XATTR}.{failing['seq']}") if failing else None
        what = (skipped or {}).get("skipped")
        if what:
            print(f"skipped {what}: its bytes stay on the node (named by `fanfs status` and at "
                  "unmount)")  # fmt: skip
        else:
            print(f"{entry.mountpoint}: nothing is failing to land: nothing skipped",
                  file=sys.stderr)  # fmt: skip
    landing = drain(entry, args.timeout)
    failed_writes(entry, ask(entry))
    print(f"{entry.mountpoint}: everything written is at DEST ({landing['landed_files']} "
          f"files, {landing['landed_bytes'] / 1e6:.1f} MB landed so far)")  # fmt: skip
    if landing.get("skipped"):
        print(f"  not landed, as asked (sync --skip): {', '.join(landing['skipped'])}")
    return ExitCode.OK


def render(status: dict[str, Any]) -> str:
    landing = status["landing"]
    lines = [
        f"output mount {status['mountpoint']} (rank {status['rank']}/{status['size']}, pid "
        f"{status['pid']}, {status['phase']}), landing at {status['dest']}",
        f"  files       {status['files']} ({status['open_handles']} open), "
        f"{status['written_bytes'] / 1e6:.1f} MB written",
        f"  landed      {landing['landed_files']} files ({landing['appended_files']} appended), "
        f"{landing['landed_bytes'] / 1e6:.1f} MB at {landing['throughput_mb_s']} MB/s; last "
        f"file took {landing['last_put_s']} s",
        f"  backlog     {landing['backlog_files']} files, {landing['backlog_bytes'] / 1e6:.1f} MB"
        f" ({landing['backlog_ops']} changes), oldest {landing['oldest_s']} s",
        f"  node's disk {status['evicted_files']} landed files evicted "
        f"({status['evicted_bytes'] / 1e6:.1f} MB), {status['read_back']} read back from DEST",
    ]  # fmt: skip
    front = status.get("front", {})
    if front.get("off"):
        lines.append(f"  front       off: {front['off']}")
    elif front.get("running"):
        lines.append(f"  front       WRITEs answered in C (kernel FUSE {front['protocol']})")
    if landing.get("recovering"):
        lines.append(f"  RECOVERING  {landing['recovering']} changes a dead daemon left")
    if landing.get("skipped"):
        lines.append(f"  SKIPPED     {', '.join(landing['skipped'])} (kept on the node)")
    if status.get("failed_writes"):
        lines.append(f"  WRITE FAILED {', '.join(status['failed_writes'])} (not landed until "
                     "written again)")  # fmt: skip
    if landing.get("failing"):
        f = landing["failing"]
        lines.append(
            f"  FAILING     {f['op']} {f['path']}: {f['error']} ({f['attempts']} attempts)"
        )
    rep = status.get("replicas")
    if rep:
        lines.append(f"  replicas    partner rank {rep['partner']}, holding {rep['held_files']} "
                     f"files of rank {rep['holding_for']}, dead ranks {rep['dead']}")  # fmt: skip
    return "\n".join(lines)


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser(
        "output", help="a writable mount whose files land on DEST (foreground)",
        description="Mount a writable directory at MOUNTPOINT whose files live on this node's "
        "disk and are copied to DEST (a directory on the shared file system) in the "
        "background, each as soon as it is closed: complete and checked under a hidden name, "
        "then renamed into place (a file that only grew: its new bytes appended). Renames and "
        "removals reach DEST in the same order. `fanfs sync` waits until all is at DEST; "
        "`fanfs umount` drains first. What a killed daemon left is landed first.",
    )  # fmt: skip
    p.add_argument("dest", metavar="DEST")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?")
    staging_options(p)
    p.add_argument("--recover", action="store_true",
                   help="without MOUNTPOINT: only land what dead daemons left for DEST in "
                   "--local, then exit (0: all landed; 8: what is left, named)")  # fmt: skip
    p.add_argument("--replicas", type=positive_int, choices=(1, 2), metavar="R",
                   help="2: under MPI, also keep each closed file on the next rank until it is "
                   "at DEST (default: 1; env FANFS_OUTPUT_REPLICAS)")  # fmt: skip
    p.add_argument("--peer-timeout", type=positive_float, metavar="S",
                   help="a partner silent this long is dead (default: 5; env "
                   "FANFS_PEER_TIMEOUT)")  # fmt: skip
    p.add_argument(
        "--drain",
        type=seconds,
        metavar="S",
        help="after a stop signal, serve open writers and land what is left for at "
        "most this long, then keep the rest locally (default: 60; env FANFS_DRAIN)",
    )
    p.add_argument("--interval", type=positive_float, metavar="S",
                   help="files open for appending (logs) land at most this far behind "
                   "(default: 10; env FANFS_OUTPUT_INTERVAL)")  # fmt: skip
    env_default(p, "replicas", "OUTPUT_REPLICAS", positive_int, 1)
    env_default(p, "peer_timeout", "PEER_TIMEOUT", positive_float, 5.0)
    env_default(p, "drain", "DRAIN", seconds, 60.0)
    env_default(p, "interval", "OUTPUT_INTERVAL", positive_float, 10.0)
    p.set_defaults(func=cmd_output)

    p = sub.add_parser("sync", help="wait until everything written under an output mount is "
                       "at DEST")  # fmt: skip
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--skip", action="store_true",
                   help="first skip the change failing to land now (its bytes stay on the "
                   "node, named): the rest lands")  # fmt: skip
    p.add_argument("--timeout", type=seconds, default=3600.0, metavar="S",
                   help="give up after this long (default: 3600)")  # fmt: skip
    p.set_defaults(func=cmd_sync)
