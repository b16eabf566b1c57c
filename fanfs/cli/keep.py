"""`fanfs keep ls`, `prune` and `verify`: what a --keep DIR holds, emptying it, checking it.

They touch only the user's own entries, and never remove one that a mount uses.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fanfs.cli.options import Subparsers, size
from fanfs.errors import ExitCode, UsageError
from fanfs.progress import human_bytes

if TYPE_CHECKING:
    from fanfs.node.keep import KeepDir


def _open(path: str) -> KeepDir:
    from fanfs.node.keep import KeepDir

    if not Path(path).is_dir():
        raise UsageError(f"{path}: not a directory")
    return KeepDir(Path(path))


def cmd_ls(args: argparse.Namespace) -> int:
    keep = _open(args.dir)
    try:
        entries = keep.entries()
    finally:
        keep.close()
    if args.json:
        print(json.dumps([{"key": e.key, "bytes": e.size, "last_used": e.last_used,
                           "image": e.image, "partition": e.part, "in_use": e.in_use}
                          for e in entries], indent=2))  # fmt: skip
        return ExitCode.OK
    now = time.time()
    for e in entries:
        age = f"{(now - e.last_used) / 3600:.1f} h ago" if e.last_used else "never sealed"
        image = e.image.encode("utf-8", "backslashreplace").decode()
        print(f"{e.key[:16]}  {human_bytes(e.size):>10}  {age:>14}  "
              f"{'in use' if e.in_use else 'free':6}  {image} partition {e.part}")  # fmt: skip
    total = sum(e.size for e in entries)
    print(f"{len(entries)} kept partitions, {human_bytes(total)} in {keep.path}")
    return ExitCode.OK


def cmd_prune(args: argparse.Namespace) -> int:
    keep = _open(args.dir)
    try:
        entries = keep.entries()
        total = sum(e.size for e in entries)
        freed = busy = 0
        for e in entries:  # least recently used first
            if total <= args.to:
                break
            if keep.evict(e.key):
                total -= e.size
                freed += e.size
            else:
                busy += 1
        keep.prune_leftovers()
    finally:
        keep.close()
    print(f"removed {keep.evicted} kept partitions ({human_bytes(freed)}); "
          f"{human_bytes(total)} left in {keep.path}"
          + (f", {busy} in use by a mount" if busy else ""))  # fmt: skip
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    keep = _open(args.dir)
    bad = unchecked = 0
    try:
        entries = keep.entries()
        for e in entries:
            why = keep.verify(e.key)
            if why == "":
                unchecked += 1
            elif why is not None:
                bad += 1
                removed = keep.evict(e.key)
                print(f"{e.key[:16]}: {why}; "
                      + ("removed" if removed else "in use by a mount, left"))  # fmt: skip
    finally:
        keep.close()
    old = f", {unchecked} of images older than format 4 not checked" if unchecked else ""
    print(f"{len(entries) - bad - unchecked} kept partitions intact, {bad} bad{old}")
    return ExitCode.FAILED if bad else ExitCode.OK


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("keep", help="see or empty a --keep DIR of kept partitions")
    ksub = p.add_subparsers(dest="keep_command", required=True, metavar="ACTION")
    q = ksub.add_parser("ls", help="the kept partitions, least recently used first")
    q.add_argument("dir", metavar="DIR")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=cmd_ls)
    q = ksub.add_parser("prune", help="remove kept partitions no mount uses, least recently "
                        "used first")  # fmt: skip
    q.add_argument("dir", metavar="DIR")
    q.add_argument("--to", type=size, default=0, metavar="SIZE",
                   help="stop once DIR holds at most SIZE (default: remove all)")  # fmt: skip
    q.set_defaults(func=cmd_prune)
    q = ksub.add_parser("verify", help="read every kept partition against its SHA-256 and "
                        "remove those whose bytes changed (exit 1 if any)")  # fmt: skip
    q.add_argument("dir", metavar="DIR")
    q.set_defaults(func=cmd_verify)
