"""Planned epochs, the job's side: tell the daemon behind a mount the order of an epoch.

    import fanfs.plan
    fanfs.plan.publish("/mnt/data", paths_in_epoch_order, share=rank_on_node)

`paths` are in the order the job will read them: absolute paths under the mount, or relative
ones, which mean what `open()` makes of them: relative to the working directory when that is
inside the mount (a job that runs in its dataset's directory), else relative to the mount.
`publish` returns once the daemon has taken the plan (a new plan for a share replaces that
share's previous one; it stays in force after this process exits), and the daemon starts
reading ahead at once (fanfs/node/planner.py). Several processes on one node (training
ranks) each publish their own share. `progress` tells the daemon how far a share's job has
read, which lets it read further ahead when the job's reads do not reach it (files already in
the page cache); a `Channel`'s `progress` returns without waiting for the daemon.
`fanfs.torch.PlannedSampler` does both for PyTorch.

The daemon is reached through an abstract Unix socket whose name `fanfs status --json` shows
(`plan_socket`); the daemon serves only its own user (and root), and the client checks that the
daemon is its user's (or root's) too.

Concurrency: plain blocking calls, from any thread or process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanfs import mounts
from fanfs.errors import FanfsError, MountpointError

PROGRESS_EVERY = 64  # samples between a planned job's progress messages (PlannedSampler, bench)
TIMEOUT_S = 300.0  # a plan of millions of paths takes the daemon seconds to resolve


class PlanRefused(FanfsError):
    """The daemon did not take the plan (its message says why)."""


class DaemonUnreachable(FanfsError):
    """The daemon's plan socket took no connection (the daemon has ended)."""


@dataclass(frozen=True)
class Taken:
    planned: int  # files the plan names, in order
    missing: int  # paths that name no file under the mount
    first_missing: str | None = None  # one of them, relative to the mount


def relative(root: str, paths: Iterable[str | os.PathLike[str]],
             base: str | None = None) -> Iterator[bytes]:  # fmt: skip
    """Each path relative to the mount at `root` (canonical), `..` and `.` resolved: absolute
    ones under `root`, relative ones under `base`, by default the working directory when it
    is inside the mount, else the mount itself. PlanRefused for a path outside the mount."""
    top = os.fsencode(root)
    prefix = top.rstrip(b"/") + b"/"
    if base is None:
        cwd = os.fsencode(os.getcwd())
        base = os.fsdecode(cwd if cwd == top or cwd.startswith(prefix) else top)
    start = os.fsencode(mounts.canonical(base))
    resolved: dict[bytes, bytes] = {}  # directories outside `root` through symlinks
    for p in paths:
        raw = os.fsencode(p)
        if b"\0" in raw:
            raise PlanRefused(f"{raw!r}: a path cannot hold a NUL byte")
        full = os.path.normpath(raw if raw.startswith(b"/") else start + b"/" + raw)
        if full != top and not full.startswith(prefix):
            head, tail = os.path.split(full)
            if head not in resolved:
                resolved[head] = os.fsencode(mounts.canonical(os.fsdecode(head)))
            full = os.path.join(resolved[head], tail)
        if full == top:
            yield b""
        elif full.startswith(prefix):
            yield full[len(prefix) :]
        else:
            raise PlanRefused(f"{os.fsdecode(raw)}: not under the mount {root}")


def publish(mountpoint: str | os.PathLike[str], paths: Iterable[str | os.PathLike[str]],
            share: int = 0, relative_to: str | os.PathLike[str] | None = None
            ) -> Taken:  # fmt: skip
    """Hand the daemon behind `mountpoint` the order in which `share` will read `paths`."""
    return Channel(mountpoint).publish(paths, share, relative_to)


def progress(mountpoint: str | os.PathLike[str], position: int, share: int = 0) -> None:
    """Tell the daemon that `share`'s job has read its plan up to `position`, waiting for
    nothing (`Channel.progress`). The way to the daemon is found once per mount and process
    (`_channel`): reading the mount's status to find it took a busy daemon 22 ms a call."""
    key, channel = _channel(mountpoint)
    try:
        channel.progress(position, share)
    except FanfsError as e:  # found again at the next call, whatever the way kept found
        _channels.pop(key, None)
        if not isinstance(e, DaemonUnreachable):
            raise  # (another user's socket under the old name: refused, never retried)
        _channel(mountpoint)[1].progress(position, share)  # its daemon gone: a new one there?


# The Channels `progress` found, per process, by (mount point, the mount's device number in
# /proc/self/mountinfo): a new mount there is another device, or the old device's number
# again, whose daemon's socket is then gone (DaemonUnreachable: found again once). Nothing
# here is a socket: a forked child may use what its parent found.
_channels: dict[tuple[str, str], Channel] = {}
CHANNELS_KEPT = 64  # mounts one process plans for, at most (more: all found again)


def _channel(mountpoint: str | os.PathLike[str]) -> tuple[tuple[str, str], Channel]:
    """(its key in `_channels`, the Channel to the daemon behind `mountpoint`), found again
    only for a new mount there. Never asks a daemon (mountinfo, not a stat: a stat of a hung
    mount would hang)."""
    root = mounts.canonical(os.fspath(mountpoint))
    entry = mounts.find(root)
    key = (root, entry.device if entry is not None else "")
    channel = _channels.get(key)
    if channel is None:
        channel = Channel(root)  # MountpointError where no fanfs mount is
        if len(_channels) >= CHANNELS_KEPT:
            _channels.clear()
        _channels[key] = channel
    return key, channel


class Channel:
    """The way to one mount's daemon, found once (`publish` and `progress` for many calls)."""

    def __init__(self, mountpoint: str | os.PathLike[str]):
        self.root = mounts.canonical(os.fspath(mountpoint))
        self.socket = socket_path(Path(self.root))

    def publish(self, paths: Iterable[str | os.PathLike[str]], share: int = 0,
                relative_to: str | os.PathLike[str] | None = None) -> Taken:  # fmt: skip
        """Hand the daemon `share`'s order (`relative`: how paths are read; `relative_to`
        overrides where relative ones start)."""
        base = None if relative_to is None else os.fspath(relative_to)
        body = bytearray()
        n = 0
        for raw in relative(self.root, paths, base):
            body += raw + b"\0"
            n += 1
        reply = self._request(f"FANFS-PLAN 1 order {int(share)} {n}\n".encode() + bytes(body))
        planned, missing = reply.get("planned"), reply.get("missing")
        if not isinstance(planned, int) or not isinstance(missing, int):
            raise FanfsError(f"{self.root}: the daemon answered {reply!r}")
        first = reply.get("first_missing")
        return Taken(planned, missing, first if isinstance(first, str) else None)

    def progress(self, position: int, share: int = 0) -> None:
        """Sent, not waited for: a daemon busy reading ahead never holds the job (a sampler
        sends one every PROGRESS_EVERY samples). One the daemon cannot take now (its socket's
        queue is full) is dropped: the next one, or the job's reads, move the plan as far."""
        message = f"FANFS-PLAN 1 at {int(share)} {int(position)}\n".encode()
        try:
            with self._connected(wait=False) as s:
                unsent = (BlockingIOError, BrokenPipeError, ConnectionResetError)  # dropped
                if s is not None:
                    with contextlib.suppress(*unsent):
                        s.send(message)  # a few bytes into an empty socket: all or nothing
        except OSError as e:
            raise self._unreachable(e) from None

    def drop(self) -> dict[str, object]:
        """Have the daemon drop what is cached of the mount's files: the kernel's pages of
        them, its staged copies' pages and its own caches (the next reads are cold). What it
        dropped, as the daemon says it."""
        return self._request(b"FANFS-PLAN 1 drop 0 0\n")

    @contextlib.contextmanager
    def _connected(self, wait: bool = True) -> Iterator[socket.socket | None]:
        """A connection to the daemon, checked to be its user's (or root's). Its queue of
        connections full: waited for (TIMEOUT_S at most), or without `wait` None."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            if wait:
                s.settimeout(TIMEOUT_S)
            else:
                s.setblocking(False)
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                try:
                    s.connect(self.socket)
                    break
                except BlockingIOError:  # the daemon's queue of connections is full
                    if not wait:
                        yield None
                        return
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            # The daemon must be of this user (or root): a name in /proc/net/unix is no proof.
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            uid = struct.unpack("3i", creds)[1]
            if uid not in (os.geteuid(), 0):
                raise FanfsError(f"{self.root}: the plan socket belongs to uid {uid}")
            yield s

    def _unreachable(self, e: OSError) -> DaemonUnreachable:
        return DaemonUnreachable(f"{self.root}: cannot reach the daemon's plan socket: {e}")

    def _request(self, message: bytes) -> dict[str, object]:
        try:
            with self._connected() as s:
                assert s is not None
                try:
                    s.sendall(message)
                    s.shutdown(socket.SHUT_WR)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the daemon refused before reading it all: its answer says why
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
        except OSError as e:
            raise self._unreachable(e) from None
        try:
            got: dict[str, object] = json.loads(reply.split(b"\n", 1)[0])
        except ValueError:
            raise FanfsError(f"{self.root}: the daemon answered {reply[:200]!r}") from None
        if "error" in got:
            raise PlanRefused(f"{self.root}: plan refused: {got['error']}")
        return got


@dataclass(frozen=True)
class Placement:
    """Where files live in the job behind one mount (`placement`)."""

    nodes: int  # daemons in the job
    node: int  # the daemon behind this mount (its rank)
    holders: list[tuple[int, ...]]  # per path asked: the daemons holding it; () if no file


def placement(mountpoint: str | os.PathLike[str],
              paths: Iterable[str | os.PathLike[str]]) -> Placement:  # fmt: skip
    """Which daemons hold each of `paths` (read as `publish` reads them). The same pure
    function the daemons place partitions with (fanfs/placement.py), computed from the
    image's catalog: no daemon is asked, so every training rank gets the same answer."""
    from fanfs.image.catalog import Catalog
    from fanfs.image.paths import resolve_many
    from fanfs.placement import place

    root = mounts.canonical(os.fspath(mountpoint))
    status = _status(Path(root))
    catalog, _ = Catalog.load(Path(str(status["image"])))
    owners = place(catalog.part_size, catalog.part_flags, int(status["size"]),
                   int(status.get("replicas", 1)))  # fmt: skip
    entries = resolve_many(catalog, list(relative(root, paths)))
    holders: list[tuple[int, ...]] = []
    for entry in entries.tolist():
        ok = entry >= 0 and bool(catalog.is_file[entry])
        holders.append(owners[int(catalog.part[entry])] if ok else ())
    return Placement(int(status["size"]), int(status["rank"]), holders)


def _status(mountpoint: Path) -> dict[str, Any]:
    entry = mounts.find(mountpoint)
    if entry is not None and entry.fstype == mounts.OUTPUT_FSTYPE:
        raise MountpointError(f"{mountpoint}: an output mount (`fanfs output`): plans and drop "
                              "are for dataset mounts")  # fmt: skip
    status = mounts.probe_status(mountpoint, 30) if entry is not None else None
    if entry is None or entry.fstype != mounts.FSTYPE or status is None:
        raise MountpointError(f"{mountpoint}: no fanfs mount there")
    return status


def socket_path(mountpoint: Path) -> str:
    """The plan socket's address for `connect` (an abstract name) of the daemon behind
    `mountpoint` (FanfsError if there is none)."""
    name = str(_status(mountpoint).get("plan_socket") or "")
    if not name.startswith("@"):
        raise FanfsError(f"{mountpoint}: this fanfs daemon takes no plans (yet)")
    return "\0" + name[1:]
