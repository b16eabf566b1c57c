"""The skeleton both daemons share (`fanfs mount`'s, node/daemon.py, and `fanfs output`'s,
output/daemon.py): stop signals, the MPI world, the start-up agreement, the mount, the end.

Order (S3QL's mount.py): `Lifecycle.run` takes the stop signals, joins the MPI world and
hands the daemon's body one exit stack, on which every resource registers its teardown the
moment it exists: the signal handlers first, then MPI's finalize, then whatever the body
builds (the mount among it). So the stack unwinds in the reverse order, whatever ends the
daemon: the body's parts (the mount goes before the staged copies), MPI, and last the
signals, which are therefore handled during the whole clean-up too.

Start-up: every check a user mistake can fail runs before anything is mounted; `agree` is
the start-up collective after each step: all ranks learn whether any failed (or was asked to
stop), so they fail together with one clear line instead of some hanging. A rank that died
or never started cannot answer one: each collective waits at most `start_timeout_s`, and a
few seconds past a stop signal (fanfs/world.py), then fails this rank with one clear line.
After start-up no collective runs (a dead rank must not block one), and MPI is not finalized
when a peer is gone or a collective was left unfinished (MPI_Finalize can wait forever).

Signals (SIGTERM, SIGINT, SIGHUP) mean "stop", whenever they come, never Python's defaults
(which would kill the daemon without cleaning up): outside trio the first one is noted (and
the next `agree` fails every rank together, exit 130); inside trio `watch_signals` hands
each one to the daemon, which decides what stopping means for it. One that came before `run`
took them, while the daemon loaded, is noted by the daemon command's `Early`
(fanfs/stopsignals.py) and taken as if it came then.

Concurrency: the main thread, outside trio (run, agree, mount, unmount) or in it
(watch_signals); the signal handler only notes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from types import FrameType
from typing import Any

import trio

from fanfs import mounts
from fanfs import world as mpi
from fanfs.errors import ExitCode, FanfsError, Interrupted, MountFailed, MountpointError
from fanfs.node import fuse_ops
from fanfs.stopsignals import STOP_SIGNALS, Early
from fanfs.threads import FINALIZING, name_os_thread


def node_name(rank: int) -> str:
    """This daemon's node: from the launcher (Slurm), else its rank; never the hostname."""
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("SLURM_NODEID") or str(rank)


def expand(template: str, rank: int, node: str) -> str:
    return template.replace("{rank}", str(rank)).replace("{node}", node)


def check_mountpoint(mountpoint: Path, nonempty: bool = False, image: Path | None = None) -> None:
    if image is not None:
        img = image.resolve()
        if mountpoint == img or mountpoint in img.parents:
            raise MountpointError(f"{mountpoint}: mounting there would hide the image {image}")
        if img in mountpoint.parents:
            raise MountpointError(f"{mountpoint}: the mount point is inside the image {image}")
    if mounts.find(mountpoint) is not None:
        raise MountpointError(f"{mountpoint}: already mounted")
    if not mountpoint.exists():
        raise MountpointError(f"{mountpoint}: mount point does not exist")
    if not mountpoint.is_dir():
        raise MountpointError(f"{mountpoint}: mount point is not a directory")
    if not nonempty:
        try:
            with os.scandir(mountpoint) as it:
                held = next(it, None)
        except OSError as e:
            raise MountpointError(f"{mountpoint}: cannot read mount point: {e.strerror}") from None
        if held is not None:
            # The mount would hide what is there (fusermount refused this for the same reason).
            raise MountpointError(
                f"{mountpoint}: mount point is not empty (holds {held.name!r}); "
                "use --nonempty to mount over it anyway"
            )


def failed(code: int, message: str) -> FanfsError:
    """The error a rank reports for another's failed start-up step, with that one's code."""
    err = FanfsError(message)
    err.exit_code = ExitCode(code)
    return err


_CODES = frozenset(int(c) for c in ExitCode)


def verdict(obj: Any, rank: int, prefix: str = "") -> FanfsError | None:
    """Rank `rank`'s start-up verdict as it came (`World.bcast`, `allgather`): None, it went
    on; [exit code, message], it failed (the error, its message after `prefix`). Checked as
    data: anything else is an error of its own."""
    if obj is None:
        return None
    if (isinstance(obj, list) and len(obj) == 2 and type(obj[0]) is int and obj[0] in _CODES
            and isinstance(obj[1], str)):  # fmt: skip
        return failed(obj[0], prefix + obj[1])
    return FanfsError(f"rank {rank} sent a start-up verdict that is not fanfs's: {obj!r:.200}")


class Lifecycle:
    """One daemon's life around its body. `log` is the daemon's logger (its lines keep their
    name); `noted`, if not None, is the line logged (with the signal's name) when a stop signal
    comes outside trio; `interrupted` the message of a start-up cut short by one (with
    `{signal}`, its name); `early`: what held the signals before (the daemon command's first
    step), whose signal counts as the first; `start_timeout_s`: how long a start-up collective
    waits for the other ranks (FANFS_START_TIMEOUT; fanfs/world.py)."""

    def __init__(self, log: logging.Logger, *, noted: str | None, interrupted: str,
                 early: Early | None = None, start_timeout_s: float | None = None):  # fmt: skip
        self.log = log
        self.start_timeout_s = start_timeout_s
        self.noted = noted
        self.interrupted = interrupted
        self.early = early
        self.rank, self.size = 0, 1
        self.world: mpi.World | None = None
        self.stop_signal = 0  # the first stop signal received
        self._mounted: Path | None = None  # the mount point, while mounted
        self._before_unmount: Callable[[], None] = lambda: None

    def run(self, body: Callable[[contextlib.ExitStack], None],
            gone: Callable[[], Collection[int]]) -> None:  # fmt: skip
        """Run `body` with the signals taken and the world joined, handing it the exit stack
        its parts register their teardown on; `gone()`: the ranks known dead at the end."""
        with contextlib.ExitStack() as stack:
            for sig in STOP_SIGNALS:
                # Once everything registered after this has run, the work is done and a stop
                # signal has nothing left to stop: ignored, not given back its default action,
                # which Python's exit would do (a daemon that had cleaned up was killed by a
                # late SIGTERM and exited -15).
                signal.signal(sig, self._on_signal)
                stack.callback(signal.signal, sig, signal.SIG_IGN)
            if self.early is not None and self.early.first:  # it came while the daemon loaded
                self._on_signal(self.early.first, None)
            self.world = mpi.join(dict(os.environ), self.start_timeout_s, self._stopped)
            if self.world is not None:
                self.rank, self.size = self.world.rank, self.world.size
                stack.callback(self._finalize, self.world, gone)
            body(stack)

    def _stopped(self) -> Interrupted | None:
        """The error a start-up cut short by a stop signal gives, once one came."""
        if not self.stop_signal:
            return None
        return Interrupted(self.interrupted.format(signal=signal.Signals(self.stop_signal).name))

    def _finalize(self, world: mpi.World, gone: Callable[[], Collection[int]]) -> None:
        dead = gone()
        if dead:  # a dead peer can make MPI_Finalize wait forever: leave without it
            self.log.warning("not finalizing MPI: ranks %s are gone", sorted(dead))
        else:
            # Nothing of this node's is left: `fanfs umount` stops waiting for a process that
            # only waits for the other ranks (Open MPI's finalize does, until they finalize).
            name_os_thread(FINALIZING)
            world.finalize()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Outside trio (start-up, clean-up): note the first stop signal, never raise."""
        if not self.stop_signal:
            self.stop_signal = signum
            if self.noted is not None:
                self.log.info(self.noted, signal.Signals(signum).name)

    def agree(self, error: FanfsError | None) -> None:
        """Raise if this rank or any other failed a start-up step (a start-up collective), or
        was asked to stop meanwhile: all ranks fail together, none waits for another."""
        if error is None:
            error = self._stopped()
        if self.world is None:
            if error is not None:
                raise error
            return
        verdicts = self.world.allgather(
            None if error is None else (int(error.exit_code), str(error))
        )
        if error is not None:
            raise error
        for rank, said in enumerate(verdicts):
            if (err := verdict(said, rank, f"rank {rank} failed to start: ")) is not None:
                raise err

    def mount(self, stack: contextlib.ExitStack, ops: Any, mountpoint: Path,
              options: set[str] = fuse_ops.MOUNT_OPTIONS, background: int = 0,
              before_unmount: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        """Mount `ops` at `mountpoint` (all ranks agree it worked, or fail together) and
        register the unmount; `before_unmount` runs first (what still answers requests in
        the session stops). `background`: as fuse_ops.mount's."""
        error = None
        try:
            fuse_ops.mount(ops, str(mountpoint), options, background)
            self._mounted = mountpoint
            self._before_unmount = before_unmount
            stack.callback(self.unmount)
        except RuntimeError as e:
            error = MountFailed(f"{mountpoint}: cannot mount: {e}")
        self.agree(error)

    def unmount(self) -> None:
        """The mount goes (idempotent): the daemon's own step first, then the session."""
        if self._mounted is not None:
            self._mounted = None
            self._before_unmount()
            fuse_ops.unmount()

    async def watch_signals(self, on_stop: Callable[[bool, trio.Nursery], Awaitable[None]], *,
                            task_status: trio.TaskStatus[None]) -> None:  # fmt: skip
        """Inside trio: hand every stop signal to `on_stop(first, nursery)` (`first`: the
        first stop signal of the daemon's life, which `stop_signal` now names; `nursery`:
        where the daemon may start what stopping takes), one after the other, one noted
        before trio took over the signals first."""
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            task_status.started()
            async with trio.open_nursery() as nursery:
                if self.stop_signal:  # it came before trio took over the signals
                    await on_stop(False, nursery)
                async for signum in signals:
                    first = not self.stop_signal
                    if first:
                        self.stop_signal = signum
                    await on_stop(first, nursery)
