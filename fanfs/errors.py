"""Exceptions named for what happened, and the one table that maps them to exit codes.

Every error a user can cause derives from `FanfsError`; the CLI prints its message on one line
and exits with its `exit_code`. Anything else is a bug and gets a traceback.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Documented exit codes of every `fanfs` subcommand (README, "Exit codes")."""

    OK = 0
    FAILED = 1  # verify found bad files, or an unexpected internal error
    USAGE = 2  # bad command line (argparse)
    SOURCE = 3  # dataset directory missing or unreadable, or IMAGE exists without --force
    IMAGE = 4  # image missing, corrupt, truncated, of an unknown version, or a partition missing
    # mount point missing, not a directory, not empty, mounted or not; bad --local or --keep
    MOUNTPOINT = 5
    TIMEOUT = 6  # `wait` or `umount` gave up after --timeout
    MOUNT = 7  # the mount itself failed (FUSE unavailable, daemon died at start)
    NOT_LANDED = 8  # output mounts: closed files not at DEST (kept; `sync` or `umount` again)
    INTERRUPTED = 130  # SIGINT during prepare; a stop signal before a mount served


class FanfsError(Exception):
    exit_code = ExitCode.FAILED


class UsageError(FanfsError):
    """A bad option value that argparse cannot check by itself."""

    exit_code = ExitCode.USAGE


class SourceError(FanfsError):
    exit_code = ExitCode.SOURCE


class ImageExists(FanfsError):
    exit_code = ExitCode.SOURCE


class ImageError(FanfsError):
    exit_code = ExitCode.IMAGE


class CorruptCatalog(ImageError):
    pass


class ImageVersionError(ImageError):
    pass


class MissingPartition(ImageError):
    pass


class MountpointError(FanfsError):
    exit_code = ExitCode.MOUNTPOINT


class StagingError(FanfsError):
    """`--local` is unsafe (another user controls it) or unusable."""

    exit_code = ExitCode.MOUNTPOINT


class WaitTimeout(FanfsError):
    exit_code = ExitCode.TIMEOUT


class MountFailed(FanfsError):
    exit_code = ExitCode.MOUNT


class Interrupted(FanfsError):
    """A stop signal came before the command had done its work (it cleaned up first)."""

    exit_code = ExitCode.INTERRUPTED


class CorruptFile(Exception):
    """One file's stored bytes do not match its checksum (reads of that file get EIO)."""


class NotLanded(FanfsError):
    """Files closed under an output mount are not at DEST (the daemon keeps them locally)."""

    exit_code = ExitCode.NOT_LANDED
