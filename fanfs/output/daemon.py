"""`fanfs output`'s daemon: check, mount, serve and land, and at the end drain or keep.

Order as the dataset daemon's (node/daemon.py): every check a user mistake can fail (DEST, the
mount point, --local, and where they lie to each other) runs before anything is mounted; under
an MPI launcher all ranks agree on the verdict, so they fail together. Then the mount serves
while the lander (lander.py) lands, first what dead daemons left for this DEST in the same
--local (recover.py), then the mount's own journal (journal.py, kept on the node as it goes).
The skeleton (stop signals, the MPI world, the start-up agreement, the mount, MPI's end) is
fanfs/lifecycle.py's, shared with the dataset daemon; the wing's parts are built in one
place, assemble.py.

A stop signal (SIGTERM from Slurm's time limit or `scancel`; `fanfs umount`, which has
drained first) ends the daemon within --drain seconds:
1. every file changed lands as it is, open ones too (the writer's bytes are not lost);
2. the mount keeps serving while files are open for writing or landings are pending, for at
   most three quarters of the drain time: a job that saves a last checkpoint when it gets the
   same signal can finish it, and its close lands it again, whole;
3. the mount goes; what was written since step 1 is put; the rest of the drain time lands.
A second signal cuts steps 2 and 3 short. Whatever is not at DEST then stays on the node: the
journal and the local files in the staging directory, named in `kept.json`; the daemon says
so on one line and exits with ExitCode.NOT_LANDED, and `fanfs output --recover DEST` (or the
next `fanfs output` with the same DEST and --local) lands it.

With `--replicas 2` under MPI, each node also holds its partner's closed files until they are
at DEST (replicas.py), and lands them itself if the partner dies first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from fanfs import mounts, native
from fanfs.errors import FanfsError, MountpointError, NotLanded, UsageError
from fanfs.lifecycle import Lifecycle, check_mountpoint, expand, node_name
from fanfs.node import fuse_ops
from fanfs.node.staging import StagingDir, default_parent
from fanfs.output import assemble, fs, recover
from fanfs.output.dest import Dest
from fanfs.output.front import sweep as sweep_kept
from fanfs.output.salvage import cancel_on, land_dead
from fanfs.stopsignals import Early
from fanfs.switches import Switches

log = logging.getLogger(__name__)

SERVE_SHARE = 0.75  # of the drain time, spent serving open writers before the unmount
POLL_S = 0.05  # while stopping: how often open writers and the lander are looked at
TERMINATE_S = 5.0  # requests in flight at the stop get this long to be answered


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dest: str
    mountpoint: str | None  # may contain {rank} and {node}; None: only --recover
    local: str | None = None
    nonempty: bool = False
    replicas: int = 1
    peer_timeout: float = 5.0
    drain: float = 60.0  # after a stop signal, land what is left for at most this long
    interval: float = 10.0  # files open for appending land at most this far behind
    max_ops: int = 1 << 20
    # FANFS_* (fanfs/switches.py), parsed by the CLI; a config made elsewhere has them all on
    switches: Switches = field(default_factory=Switches)


def _inside(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_dest(dest: Path, mountpoint: Path | None, local: Path) -> None:
    """MountpointError for a DEST that would fail later, or that would land into itself."""
    try:
        real = dest.resolve(strict=True)
    except OSError as e:
        raise MountpointError(f"{dest}: output destination: {e.strerror or e}") from None
    if not real.is_dir():
        raise MountpointError(f"{dest}: output destination is not a directory")
    if mountpoint is not None:
        if _inside(real, mountpoint):
            raise MountpointError(f"{dest}: the output destination is inside the mount point")
        if _inside(mountpoint, real):
            raise MountpointError(f"{mountpoint}: the mount point is inside the output "
                                  f"destination {dest}: its files would land into the mount "
                                  "itself")  # fmt: skip
    if _inside(local.resolve(), real):
        raise MountpointError(f"{local}: --local is inside the output destination {dest}: the "
                              "node's copies would show there")  # fmt: skip
    if not os.access(real, os.W_OK | os.X_OK):
        raise MountpointError(
            f"{dest}: output destination not writable by you (uid {os.geteuid()})"
        )


class OutputDaemon:
    def __init__(self, cfg: OutputConfig, early: Early | None = None):
        """`early`: what held the stop signals since the command's start (stopsignals)."""
        self.cfg = cfg
        self.started = time.time()
        self.life = Lifecycle(log, noted=None, interrupted="stopped before serving", early=early,
                              start_timeout_s=cfg.switches.start_timeout_s)  # fmt: skip
        self.phase = "starting"
        self.mountpoint = Path(cfg.mountpoint or ".")
        self.dest = Path(cfg.dest)
        self.staging: StagingDir | None = None
        self.wing: assemble.Wing | None = None  # every part of the daemon, once built
        self._hurry = trio.Event()  # a second signal: stop waiting
        self._signalled = False  # a first signal was handled
        self._deadline = 0.0
        self._serve_scope = trio.CancelScope()  # the FUSE loop, cut short if it will not end

    def status(self) -> assemble.OutputStatus:
        assert self.wing is not None
        return assemble.report(self.wing, rank=self.rank, size=self.size,
                               node=node_name(self.rank), mountpoint=str(self.mountpoint),
                               dest=str(self.dest), phase=self.phase,
                               started=self.started)  # fmt: skip

    @property
    def rank(self) -> int:
        return self.life.rank

    @property
    def size(self) -> int:
        return self.life.size

    def run(self) -> None:
        self.life.run(self._run, self._gone)

    def _gone(self) -> Collection[int]:
        """The partners known dead (MPI is not finalized with them)."""
        rep = self.wing.replicas if self.wing is not None else None
        return rep.dead if rep is not None else ()

    def _paths(self) -> Path:
        """This rank's mount point, DEST and --local, checked; the --local parent."""
        cfg = self.cfg
        node = node_name(self.rank)
        if cfg.mountpoint is not None:
            self.mountpoint = Path(mounts.canonical(expand(cfg.mountpoint, self.rank, node)))
        self.dest = Path(os.path.abspath(expand(cfg.dest, self.rank, node)))
        local = Path(os.path.abspath(expand(cfg.local or default_parent(), self.rank, node)))
        if cfg.mountpoint is not None:
            check_mountpoint(self.mountpoint, cfg.nonempty)
        check_dest(self.dest, self.mountpoint if cfg.mountpoint is not None else None, local)
        return local

    def _run(self, stack: contextlib.ExitStack) -> None:
        cfg = self.cfg
        if self.life.world is None and cfg.replicas > 1:
            raise UsageError("--replicas 2 needs an MPI launcher (mpirun, srun --mpi=pmix) "
                             "with at least 2 ranks")  # fmt: skip
        if cfg.replicas > 1 and self.size < 2:
            self.life.agree(UsageError("--replicas 2 needs at least 2 ranks"))
        error = None
        try:
            local = self._paths()
            dest = Dest(str(self.dest))
            self.staging = staging = StagingDir(local)
            stack.callback(self._close_staging, staging)
        except FanfsError as e:
            error = e
        except OSError as e:
            error = MountpointError(f"{self.dest}: output destination: {e.strerror or e}")
        self.life.agree(error)
        dead = recover.find(local, str(self.dest))
        sweep_kept()  # (after the recovery of what this --local holds)
        for d in dead:
            stack.callback(d.close)
        # This daemon's name in DEST (temporary names, the replicas' marker): pids repeat
        # across nodes.
        token = assemble.new_token(self.rank)
        place = assemble.Place(self.life.world, self.rank, self.size, str(self.mountpoint),
                               str(self.dest), token)  # fmt: skip
        self.wing = wing = assemble.build(
            stack, place, dest, staging, dead, replicas=cfg.replicas,
            peer_timeout=cfg.peer_timeout, max_ops=cfg.max_ops,
            status=lambda: self.status().to_json(), pretend=cfg.switches.pretend_protocol,
        )  # fmt: skip
        if cfg.mountpoint is None:
            self._recover_only()
            return
        self.life.mount(stack, wing.ops, self.mountpoint, fs.mount_options(str(staging.path)),
                        before_unmount=wing.front.stop)  # fmt: skip
        wing.front.start(stack)
        log.info("output %s: files land at %s, local %s", self.mountpoint, self.dest,
                 staging.path)  # fmt: skip
        trio.run(self._serve)
        self._verdict()

    def _verdict(self) -> None:
        """NotLanded, naming what, if anything written is not at DEST."""
        w = self.wing
        assert w is not None
        why = []
        left = sorted(w.view.unlanded())
        if left or not w.lander.idle():
            named = ", ".join(left[:10]) + (" ..." if len(left) > 10 else "")
            why.append(f"{len(left)} files not at {self.dest}, kept in {w.staging.path} "
                       f"(kept.json names each; `fanfs output --recover {self.dest}` lands "
                       f"them): {named or '(renames and removals only)'}")  # fmt: skip
        failed = w.view.failed_files()
        if failed:
            why.append(f"{len(failed)} files whose last write failed, not landed (DEST keeps "
                       f"their last good version): {', '.join(failed[:10])}")  # fmt: skip
        if w.replicas is not None and w.replicas.failed:
            why.append(f"rank {w.replicas.owner}'s changes held here not landed "
                       f"({w.replicas.failed}), kept in {w.staging.path}")  # fmt: skip
        skipped = w.view.skipped_files()
        if skipped:
            log.warning("not landed, as asked (fanfs sync --skip): %s; kept in %s (kept.json "
                        "names each)", ", ".join(sorted(skipped)[:10]),
                        w.staging.path)  # fmt: skip
        if why:
            raise NotLanded("; ".join(why))

    def _recover_only(self) -> None:
        """`fanfs output --recover DEST` without a mount point: land what dead daemons left."""
        assert self.wing is not None
        if not self.wing.lander.recovering:
            log.info("nothing left by a dead daemon for %s", self.dest)
            return
        land_dead(self.wing.lander)

    def _close_staging(self, staging: StagingDir) -> None:
        """However the daemon ends (an exception too): what did not land is kept, named."""
        w = self.wing
        if w is not None:
            files, skipped = w.view.unlanded(), w.view.skipped_files()
            if files or skipped or w.journal.head() is not None:
                staging.keep_contents()
                try:
                    _write_json(staging.fd, recover.KEPT, {"dest": str(self.dest),
                                                           "files": files,
                                                           "skipped": skipped})  # fmt: skip
                except OSError as e:
                    log.error("kept.json not written in %s: %s", staging.path, e.strerror)
        rep = w.replicas if w is not None else None
        if rep is not None and rep.holding and (staging.keep or rep.failed):
            staging.keep_contents()
            try:  # a dead or slow partner's copies, and where they belong
                _write_json(staging.fd, "held.json", {
                    "dest": rep.owner_dest, "local_name": f"r{rep.owner}-<seq>",
                    "ops": [op.record() for op in rep.holding]})  # fmt: skip
            except OSError as e:
                log.error("held.json not written in %s: %s", staging.path, e.strerror)
        if not staging.keep:
            for name in os.listdir(staging.fd):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.stat(name, dir_fd=staging.fd,
                                            follow_symlinks=False).st_mode):  # fmt: skip
                        os.unlink(name, dir_fd=staging.fd)
        staging.close()

    async def _after_init(self) -> None:
        await trio.sleep(1.0)  # the kernel's INIT is answered by fuse_ops.serve, first
        if self.wing is not None:
            f = self.wing.front.statistics()
            native.log_front(f.protocol, f.off, "WRITEs")

    async def _serve(self) -> None:
        w = self.wing
        assert w is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(self.life.watch_signals, self._on_stop)
            nursery.start_soon(w.lander.run)
            nursery.start_soon(self._periodic)
            nursery.start_soon(self._after_init)
            if w.replicas is not None:
                await nursery.start(w.replicas.run)
            self.phase = "serving"
            with self._serve_scope:
                await fuse_ops.serve()
            if not self._deadline:  # unmounted from outside, without a signal
                self._deadline = trio.current_time() + self.cfg.drain
            self.phase = "draining"
            self.life.unmount()
            await w.view.put_all()  # what was written while the mount stopped
            w.lander.poke()
            with trio.move_on_at(self._deadline) as scope:
                give_up = 0
                if self._hurry.is_set():  # land what lands at once: one more try of a failing op
                    give_up = 1
                else:
                    nursery.start_soon(self._cancel_on_hurry, scope)
                with contextlib.suppress(Exception):
                    await w.lander.wait_landed(w.journal.enqueued, give_up_after_failures=give_up)
            if w.replicas is not None:
                left = not w.lander.idle()
                with trio.CancelScope() as scope:
                    nursery.start_soon(self._cancel_on_hurry, scope)
                    await w.replicas.finish(self.cfg.drain, not left, w.journal.landed_seq())
                if not left and w.replicas.partner in w.replicas.dead:
                    w.lander.forget_marker()  # no partner left to read it (or remove it)
            self.phase = "closing"
            nursery.cancel_scope.cancel()

    async def _cancel_on_hurry(self, scope: trio.CancelScope) -> None:
        await cancel_on(self._hurry, scope)

    async def _periodic(self) -> None:
        """Files open for appending (logs) land every `interval` seconds, as appends."""
        assert self.wing is not None
        view = self.wing.view
        while True:
            await trio.sleep(self.cfg.interval)
            if self.phase == "serving":
                await view.put_all(cond=True, appending=True)

    async def _stop(self) -> None:
        """Steps 1 and 2 of a stop (module docstring); then the mount goes."""
        w = self.wing
        assert w is not None
        now = trio.current_time()
        await w.view.put_all()
        w.lander.poke()
        with trio.move_on_at(now + self.cfg.drain * SERVE_SHARE) as scope:
            if self._hurry.is_set():
                scope.cancel()
            while w.view.writers_open() or not w.lander.idle():
                await trio.sleep(POLL_S)
                if self._hurry.is_set():
                    break
        w.view.stop_waiting()  # an fsync waiting for DEST answers now
        fuse_ops.terminate()
        # The loop returns once the requests in it are answered; one that will not be (a
        # read stuck in a hung DEST) is cancelled, and the kernel fails it at the unmount.
        await trio.sleep(TERMINATE_S)
        self._serve_scope.cancel()

    async def _on_stop(self, first: bool, nursery: trio.Nursery) -> None:
        if not self._signalled:  # the first signal (serving, or about to)
            self._signalled = True
            log.info("%s: landing what is written, then unmounting",
                     signal.Signals(self.life.stop_signal).name)  # fmt: skip
            if not self._deadline:
                self._deadline = trio.current_time() + self.cfg.drain
            nursery.start_soon(self._stop)
        elif not self._hurry.is_set():
            log.info("a second signal: not waiting any more, keeping what has not landed")
            self._hurry.set()


def _write_json(dir_fd: int, name: str, obj: Any) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600,
                 dir_fd=dir_fd)  # fmt: skip
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
