"""`fanfs <subcommand>`: the parser, logging set-up and the error-to-exit-code edge.

One module per command family builds its subcommands (image: prepare, info, verify; mount:
mount, plan, wait, umount, status; output: output, sync; keep: keep ls, keep prune; bench:
bench, project); `options` holds the value checks they share. Options come from the command
line, then `FANFS_*` environment variables, then defaults, all checked inside `main`'s error
handling. A
`FanfsError`, a bad option value or a bad variable prints one line (`fanfs: error: ...`) and
exits with its documented code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from fanfs import logs
from fanfs.cli import bench, image, keep, mount, output
from fanfs.cli.options import check_environment, resolve_env
from fanfs.errors import ExitCode, FanfsError, UsageError


class Parser(argparse.ArgumentParser):
    """argparse's checks, reported the way every other fanfs error is: one line."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("fanfs").strip()
        where = f"{command}: " if command else ""
        raise UsageError(f"{where}{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fanfs", description="Transient distributed file system for deep-learning I/O."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    image.add_parsers(sub)
    mount.add_parsers(sub)
    output.add_parsers(sub)
    keep.add_parsers(sub)
    bench.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_environment(dict(os.environ))
        logs.configure(-1 if args.quiet else args.verbose)
        resolve_env(args)
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
