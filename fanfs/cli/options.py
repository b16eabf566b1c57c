"""Option values: one converter per kind of value, the same for the command line and for
`FANFS_*` environment variables, and checks of output files before any work is done.

A converter raises `argparse.ArgumentTypeError` with a message that names what is wrong;
argparse turns it into a usage error for a command-line value, `resolve_env` into one naming
the variable. Numbers are finite (no `nan`, no `inf`) and in their range; nothing reaches the
code that uses them otherwise.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fanfs.errors import UsageError
from fanfs.progress import parse_size
from fanfs.switches import Switches

Convert = Callable[[str], Any]
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[Any]  # what each command family adds to
else:
    Subparsers = argparse._SubParsersAction
ENV_PREFIX = "FANFS_"
# Key of a subcommand's default from the environment: _env_<dest> = (var, convert, fallback).
_ENV_KEY = "_env_"


def _number(text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive_int(text: str) -> int:
    value: int = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def positive_float(text: str) -> float:
    value: float = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text}")
    return value


def seconds(text: str) -> float:
    """A duration: finite, at least 0."""
    value: float = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text}")
    return value


def fraction(text: str) -> float:
    value: float = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1: {text}")
    return value


def share(text: str) -> int:
    value: int = _number(text, int)
    if not 0 <= value < 1 << 31:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2147483647: {value}")
    return value


def size(text: str) -> int:
    """A size in bytes, `64M` or `1.5G` or `4096`, at least 1 byte."""
    try:
        value = parse_size(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 128K, 64M, 2G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte: {text!r}")
    return value


def listed(convert: Convert) -> Convert:
    """A comma-separated list of values of one kind, at least one."""

    def many(text: str) -> list[Any]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("an empty list")
        return [convert(t.strip()) for t in items]

    return many


def ratio(text: str) -> float:
    """A compression ratio: decoded over stored bytes, at least 1."""
    value: float = _number(text, float)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def choice(*allowed: str) -> Convert:
    def pick(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(allowed)}")
        return text

    return pick


def env_default(
    p: argparse.ArgumentParser, dest: str, var: str, convert: Convert, fallback: Any
) -> None:
    """`dest` of subcommand `p` comes from FANFS_<var> when not given on the command line
    (its argument's default must be None), else `fallback`. Read only when the subcommand
    runs, so a bad variable for `mount` never breaks `info`."""
    p.set_defaults(**{_ENV_KEY + dest: (var, convert, fallback)})


def staging_options(p: argparse.ArgumentParser) -> None:
    """--local and --nonempty, as every daemon (mount, output) takes them."""
    p.add_argument("--local", metavar="DIR",
                   help="directory in which to create the private staging directory (default: "
                   "$TMPDIR; env FANFS_LOCAL)")  # fmt: skip
    p.add_argument(
        "--nonempty", action="store_true", help="mount over a non-empty directory (hiding it)"
    )
    env_default(p, "local", "LOCAL", str, None)


def resolve_env(args: argparse.Namespace) -> None:
    """Fill every option left unset from its environment variable (UsageError naming the
    variable if its value is bad), else its fallback."""
    for key, spec in list(vars(args).items()):
        if not key.startswith(_ENV_KEY):
            continue
        var, convert, fallback = spec
        dest = key[len(_ENV_KEY) :]
        delattr(args, key)
        if getattr(args, dest) is not None:
            continue
        raw = os.environ.get(ENV_PREFIX + var)
        if raw is None or raw == "":
            setattr(args, dest, fallback)
            continue
        try:
            setattr(args, dest, convert(raw))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{ENV_PREFIX}{var}={raw!r}: {e}") from None


# The variables read by the daemons rather than as an option's default (switches for
# comparison, the log level, a test's pretend kernel): checked here, once, before any work, so
# a bad value is one line and exit 2, never a traceback or a silent default.
_SWITCH = ("0", "1")


def _level(raw: str) -> bool:
    return isinstance(logging.getLevelName(raw.upper()), int)  # DEBUG ... CRITICAL, WARN, ...


def _pretend(raw: str) -> bool:
    major, _, minor = raw.partition(".")
    return major == "7" and minor.isdigit() and 12 <= int(minor) <= 63


CHECKED_ENV: dict[str, tuple[Callable[[str], bool], str]] = {
    "FRONT": (lambda v: v in _SWITCH, "0 (off) or 1 (on)"),
    "NATIVE_DECODE": (lambda v: v in _SWITCH, "0 (off) or 1 (on)"),
    "NATIVE_REMOTE": (lambda v: v in _SWITCH, "0 (off) or 1 (on)"),
    "PUSH": (lambda v: v in _SWITCH, "0 (off) or 1 (on)"),
    "PLANE": (lambda v: v in _SWITCH, "0 (off) or 1 (on)"),
    "SPIN_US": (lambda v: v.isascii() and v.isdecimal(), "a whole number of microseconds"),
    "BACKGROUND": (
        lambda v: v.isascii() and v.isdecimal() and int(v) < 1 << 16,
        "a whole number of requests below 65536",
    ),
    "START_TIMEOUT": (
        lambda v: v.isascii() and v.isdecimal() and 0 < int(v) < 1 << 31,
        "a whole number of seconds, at least 1",
    ),
    "LOG_LEVEL": (_level, "a log level: DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    "PRETEND_PROTOCOL": (_pretend, "7.N, a FUSE protocol from 7.12 (tests only)"),
}


def check_environment(environ: dict[str, str]) -> None:
    """UsageError naming the first FANFS_* variable of CHECKED_ENV whose value is bad."""
    for var, (ok, expected) in CHECKED_ENV.items():
        raw = environ.get(ENV_PREFIX + var)
        if raw is not None and raw.strip() and not ok(raw.strip()):
            raise UsageError(f"{ENV_PREFIX}{var}={raw!r}: expected {expected}")


def switches() -> Switches:
    """The daemons' FANFS_* switches (fanfs/switches.py), parsed here, by the CLI, into the
    configuration it hands the daemon (their values were checked by `check_environment`)."""
    return Switches.from_environ(os.environ)


def writable(path: str | os.PathLike[str] | None, option: str) -> None:
    """Fail now, before hours of work, if `path` cannot be written."""
    if path is None:
        return
    p = Path(os.path.abspath(path))
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if p.exists():
        ok, where = os.access(p, os.W_OK), p
    else:
        ok, where = p.parent.is_dir() and os.access(p.parent, os.W_OK | os.X_OK), p.parent
    if not ok:
        raise UsageError(f"{option} {path}: cannot write to {where}")
