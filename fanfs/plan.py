"""Planned epochs, the job's side: tell the daemon behind a mount the order of an epoch.

    import fanfs.plan
    fanfs.plan.publish("/mnt/data", paths_in_epoch_order, share=rank_on_node)

`paths` are absolute paths under the mount or paths relative to it, in the order the job will
read them. `publish` returns once the daemon has taken the plan (a new plan for a share
replaces that share's previous one; it stays in force after this process exits), and the
daemon starts reading ahead at once (fanfs/planner.py). Several processes on one node (training
ranks) each publish their own share. `progress` tells the daemon how far a share's job has
read, which lets it read further ahead when the job's reads do not reach it (files already in
the page cache); `fanfs.torch.PlannedSampler` does both for PyTorch.

The daemon is reached through a Unix socket in its private staging directory, whose path
`fanfs status --json` shows (`plan_socket`); only the user who mounted can reach it.

Concurrency: plain blocking calls, from any thread or process.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fanfs import mounts
from fanfs.errors import FanfsError

TIMEOUT_S = 300.0  # a plan of millions of paths takes the daemon seconds to resolve


class PlanRefused(FanfsError):
    """The daemon did not take the plan (its message says why)."""


@dataclass(frozen=True)
class Taken:
    planned: int  # files the plan names, in order
    missing: int  # paths that name no file under the mount


def publish(mountpoint: str | os.PathLike[str], paths: Iterable[str | os.PathLike[str]],
            share: int = 0) -> Taken:  # fmt: skip
    """Hand the daemon behind `mountpoint` the order in which `share` will read `paths`."""
    return Channel(mountpoint).publish(paths, share)


def progress(mountpoint: str | os.PathLike[str], position: int, share: int = 0) -> None:
    """Tell the daemon that `share`'s job has read its plan up to `position`."""
    Channel(mountpoint).progress(position, share)


class Channel:
    """The way to one mount's daemon, found once (`publish` and `progress` for many calls)."""

    def __init__(self, mountpoint: str | os.PathLike[str]):
        self.root = Path(mountpoint).absolute()
        self.socket = socket_path(self.root)

    def publish(self, paths: Iterable[str | os.PathLike[str]], share: int = 0) -> Taken:
        prefix = os.fsencode(self.root) + b"/"
        body = bytearray()
        n = 0
        for p in paths:
            raw = os.fsencode(p)
            if raw.startswith(b"/"):
                if not raw.startswith(prefix):
                    raise PlanRefused(f"{os.fsdecode(raw)}: not under {self.root}")
                raw = raw[len(prefix) :]
            if b"\0" in raw:
                raise PlanRefused(f"{raw!r}: a path cannot hold a NUL byte")
            body += raw + b"\0"
            n += 1
        reply = self._request(f"FANFS-PLAN 1 order {int(share)} {n}\n".encode() + bytes(body))
        planned, missing = reply.get("planned"), reply.get("missing")
        if not isinstance(planned, int) or not isinstance(missing, int):
            raise FanfsError(f"{self.root}: the daemon answered {reply!r}")
        return Taken(planned, missing)

    def progress(self, position: int, share: int = 0) -> None:
        self._request(f"FANFS-PLAN 1 at {int(share)} {int(position)}\n".encode())

    def _request(self, message: bytes) -> dict[str, object]:
        path = self.socket
        try:
            dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise FanfsError(f"{self.root}: cannot reach the daemon's plan socket: {e}") from None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(TIMEOUT_S)
                # Through the directory's fd: socket paths are limited to 107 bytes.
                s.connect(f"/proc/self/fd/{dirfd}/{path.name}")
                s.sendall(message)
                s.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
        except OSError as e:
            raise FanfsError(f"{self.root}: cannot reach the daemon's plan socket: {e}") from None
        finally:
            os.close(dirfd)
        try:
            got: dict[str, object] = json.loads(reply)
        except ValueError:
            raise FanfsError(f"{self.root}: the daemon answered {reply[:200]!r}") from None
        if "error" in got:
            raise PlanRefused(f"{self.root}: plan refused: {got['error']}")
        return got


def socket_path(mountpoint: Path) -> Path:
    """The plan socket of the daemon behind `mountpoint` (FanfsError if there is none)."""
    entry = mounts.find(mountpoint)
    status = mounts.probe_status(mountpoint, 30) if entry is not None else None
    if entry is None or entry.fstype != mounts.FSTYPE or status is None:
        raise FanfsError(f"{mountpoint}: no fanfs mount there")
    path = str(status.get("plan_socket") or "")
    if not path:
        raise FanfsError(f"{mountpoint}: this fanfs daemon takes no plans (yet)")
    return Path(path)
