"""`fanfs prepare`, `info` and `verify`: making an image and looking at one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fanfs.cli.options import Subparsers, choice, env_default, positive_int, size
from fanfs.errors import ExitCode

MODES = ("auto", "private", "group", "public")


def compress_spec(text: str) -> str:
    from fanfs.image.codec import parse_compress

    try:
        parse_compress(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_prepare(args: argparse.Namespace) -> int:
    from fanfs.prepare import main_summary, prepare

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
    from fanfs.image.verify import format_info, info

    d = info(Path(args.image), args.local_capacity, args.replicas)
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    from fanfs.image.verify import verify

    bad = 0
    for line in verify(Path(args.image)):
        print(line, flush=True)
        bad += 1
    print(f"verify {args.image}: {'OK' if not bad else f'{bad} problems'}", file=sys.stderr)
    return ExitCode.FAILED if bad else ExitCode.OK


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("prepare", help="pack a dataset directory into a prepared image")
    p.add_argument("src", metavar="SRC")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument(
        "--partitions",
        type=positive_int,
        metavar="P",
        help="number of partition files (default: one per 64 MiB, 16 to 1024)",
    )
    p.add_argument(
        "--compress",
        type=compress_spec,
        metavar="auto|zstd|none[:LEVEL]",
        help="auto (default): zstd where it pays, raw for the rest (JPEG, PNG, "
        "gzip...); zstd: wherever it makes a file smaller; none: all raw. LEVEL: "
        "zstd level (3). Env FANFS_COMPRESS",
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        metavar="J",
        help="reader/compressor processes (default: cores, at most 8)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace IMAGE if it is an existing fanfs image"
    )
    p.add_argument(
        "--mode",
        type=choice(*MODES),
        metavar="|".join(MODES),
        help="who may read the image: auto (default: as private as the most "
        "private source file), private (you), group (you and your group), public "
        "(every user). Env FANFS_MODE",
    )
    p.add_argument(
        "--broadcast",
        action="append",
        default=[],
        metavar="GLOB",
        help="files every node holds in full (e.g. 'val/**'); repeatable",
    )
    env_default(p, "compress", "COMPRESS", compress_spec, "auto")
    env_default(p, "mode", "MODE", choice(*MODES), "auto")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("info", help="describe a prepared image")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--local-capacity",
        type=size,
        metavar="SIZE",
        help="local disk per node (e.g. 60G): how many nodes the image needs, and would need raw",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        metavar="R",
        help="for --local-capacity (default: 1)",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("verify", help="recompute every checksum of a prepared image")
    p.add_argument("image", metavar="IMAGE")
    p.set_defaults(func=cmd_verify)
