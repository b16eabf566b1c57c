"""`fanfs output`'s daemon: check, mount, serve and land, and at the end drain or keep.

Order as the dataset daemon's (node/daemon.py): every check a user mistake can fail (DEST, the
mount point, --local) runs before anything is mounted; under an MPI launcher all ranks agree
on the verdict, so they fail together. Then the mount serves while the journal lands on DEST
in the background (lander.py). A stop signal (`fanfs umount`, which has drained first; SIGTERM
from Slurm) ends the FUSE session; the daemon then lands what is left, for at most --drain
seconds. Whatever is still not at DEST then is kept, never deleted: the local files stay in
the staging directory with `journal.json` naming where each belongs, the daemon says so on
one line and exits with ExitCode.NOT_LANDED.

With `--replicas 2` under MPI, each node also holds its partner's closed files until they are
at DEST (replicas.py), and lands them itself if the partner dies first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from fanfs import mounts
from fanfs.errors import ExitCode, FanfsError, Interrupted, MountFailed, MountpointError, NotLanded
from fanfs.native import lib
from fanfs.node import fuse_ops
from fanfs.node.daemon import STOP_SIGNALS, check_mountpoint, expand, node_name
from fanfs.node.staging import StagingDir, default_parent
from fanfs.output import fs
from fanfs.output.dest import PUT, Op
from fanfs.output.lander import Lander
from fanfs.output.replicas import MAX_HELD, Replicas
from fanfs.output.tree import Tree

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dest: str
    mountpoint: str  # may contain {rank} and {node}
    local: str | None = None
    nonempty: bool = False
    replicas: int = 1
    peer_timeout: float = 5.0
    drain: float = 60.0  # after a stop signal, land what is left for at most this long
    max_ops: int = 1 << 20


def open_dest(dest: Path, mountpoint: Path) -> int:
    """DEST's directory fd (symlinks in DEST's own path are the user's; inside it none is
    followed); MountpointError for anything that would fail later."""
    try:
        real = dest.resolve(strict=True)
    except OSError as e:
        raise MountpointError(f"{dest}: output destination: {e.strerror or e}") from None
    if not real.is_dir():
        raise MountpointError(f"{dest}: output destination is not a directory")
    if real == mountpoint or mountpoint in real.parents:
        raise MountpointError(f"{dest}: the output destination is inside the mount point")
    if not os.access(real, os.W_OK | os.X_OK):
        raise MountpointError(
            f"{dest}: output destination not writable by you (uid {os.geteuid()})"
        )
    return os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


class OutputDaemon:
    def __init__(self, cfg: OutputConfig):
        self.cfg = cfg
        self.started = time.time()
        self.rank, self.size = 0, 1
        self.world: Any = None
        self.phase = "starting"
        self.stop_signal = 0
        self.mountpoint = Path(cfg.mountpoint)
        self.dest = Path(cfg.dest)
        self.tree: Tree | None = None
        self.lander: Lander | None = None
        self.ops: fs.OutputOperations | None = None
        self.replicas: Any = None  # replicas.Replicas under MPI with --replicas 2
        self._mounted = False
        self._front = False  # the front's threads answer WRITEs
        self._drain_scope = trio.CancelScope()

    def status(self) -> dict[str, Any]:
        assert self.lander is not None and self.tree is not None
        out = {
            "kind": "output", "pid": os.getpid(), "rank": self.rank, "size": self.size,
            "node": node_name(self.rank), "mountpoint": str(self.mountpoint),
            "dest": str(self.dest), "serving": self.phase == "serving", "phase": self.phase,
            "uptime_s": round(time.time() - self.started, 1), "files": self.tree.files,
            "open_handles": len(self.ops.handles) if self.ops else 0,
            "written_bytes": self.tree.bytes_written + _front_written(),
            "failed_writes": self.ops.failed_files()[:20] if self.ops else [],
            "landing": self.lander.statistics(),
        }  # fmt: skip
        if self.replicas is not None:
            out["replicas"] = self.replicas.statistics()
        return out

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stop_signal:
            self.stop_signal = signum

    def run(self) -> None:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            self._start_world()
            try:
                self._run()
            finally:
                if self.world is not None:
                    if self.replicas is not None and self.replicas.dead:
                        log.warning("not finalizing MPI: ranks %s are gone",
                                    sorted(self.replicas.dead))  # fmt: skip
                    else:
                        self.world.finalize()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_world(self) -> None:
        from fanfs import world as mpi

        self.world = mpi.join(dict(os.environ))
        if self.world is None:
            if self.cfg.replicas > 1:
                raise FanfsError("--replicas 2 needs an MPI launcher (mpirun, srun --mpi=pmix) "
                                 "with at least 2 ranks")  # fmt: skip
            return
        self.rank, self.size = self.world.rank, self.world.size

    def _agree(self, error: FanfsError | None) -> None:
        if error is None and self.stop_signal:
            error = Interrupted("stopped before serving")
        if self.world is not None:
            verdicts = self.world.allgather(
                None if error is None else (int(error.exit_code), str(error))
            )
            if error is None:
                for rank, verdict in enumerate(verdicts):
                    if verdict is not None:
                        error = FanfsError(f"rank {rank} failed to start: {verdict[1]}")
                        error.exit_code = ExitCode(verdict[0])
        if error is not None:
            raise error

    def _run(self) -> None:
        cfg = self.cfg
        node = node_name(self.rank)
        self.mountpoint = Path(mounts.canonical(expand(cfg.mountpoint, self.rank, node)))
        self.dest = Path(os.path.abspath(expand(cfg.dest, self.rank, node)))
        local = Path(os.path.abspath(expand(cfg.local or default_parent(), self.rank, node)))
        if cfg.replicas > 1 and self.size < 2:
            self._agree(FanfsError("--replicas 2 needs at least 2 ranks"))
        with contextlib.ExitStack() as stack:
            error = None
            try:
                check_mountpoint(self.mountpoint, cfg.nonempty)
                dest_fd = open_dest(self.dest, self.mountpoint)
                stack.callback(os.close, dest_fd)
                staging = StagingDir(local)
                stack.callback(self._close_staging, staging)
            except FanfsError as e:
                error = e
            self._agree(error)
            self.tree = Tree(staging.fd, mode=0o777 & ~_umask())
            # This daemon's name in DEST (temporary names, the replicas' marker): pids repeat
            # across nodes.
            token = f"{self.rank}-{secrets.token_hex(4)}"
            on_enqueued: Any = None
            if cfg.replicas > 1:
                # A start-up collective: each rank learns its owner's token and DEST (which may
                # differ per node: {node}), to land the owner's files there if it dies.
                peers = self.world.allgather((token, str(self.dest)))
                owner_token, owner_dest = peers[(self.rank - 1) % self.size]
                self.replicas = Replicas(self.world, staging, self.tree.open_local_or_none,
                                         owner_dest, owner_token, cfg.peer_timeout)  # fmt: skip
                on_enqueued = self.replicas.enqueued
            # With replicas, no more pending changes than the partner holds for us.
            max_ops = cfg.max_ops if self.replicas is None else min(cfg.max_ops, MAX_HELD)
            self.lander = Lander(dest_fd, self.tree.open_local_or_none, token, max_ops,
                                 on_enqueued=on_enqueued or (lambda op: None),
                                 on_landed=self._landed,
                                 marker=self.replicas is not None)  # fmt: skip
            self.ops = fs.OutputOperations(
                self.tree,
                self.lander,
                self.status,
                self.replicas.replicate if self.replicas is not None else None,
            )
            error = None
            try:
                fuse_ops.mount(self.ops, str(self.mountpoint), fs.MOUNT_OPTIONS)
                self._mounted = True
                stack.callback(self._unmount)
            except RuntimeError as e:
                error = MountFailed(f"{self.mountpoint}: cannot mount: {e}")
            self._agree(error)
            self._front = _start_front(stack)
            log.info("output %s: files land at %s, local %s", self.mountpoint, self.dest,
                     staging.path)  # fmt: skip
            trio.run(self._serve)
            why = []
            if self.lander.journal:
                files = self.lander.pending_files()
                named = ", ".join(files[:10]) + (" ..." if len(files) > 10 else "")
                why.append(
                    f"{len(files)} closed files not at {self.dest}, kept in {staging.path} "
                    f"(journal.json says where each belongs): {named}"
                )
            failed = self.ops.failed_files()
            if failed:
                why.append(f"{len(failed)} files whose last write failed, not landed (DEST keeps "
                           f"their last good version): {', '.join(failed[:10])}")  # fmt: skip
            if self.replicas is not None and self.replicas.failed:
                why.append(f"rank {self.replicas.owner}'s changes held here not landed "
                           f"({self.replicas.failed}), kept in {staging.path}")  # fmt: skip
            if why:
                raise NotLanded("; ".join(why))

    def _landed(self, op: Op) -> None:
        if op.kind == PUT:
            assert self.tree is not None
            self.tree.release(op.ino)  # its data may go now
        if self.replicas is not None:
            self.replicas.landed(op)

    @staticmethod
    def _keep(staging: StagingDir, name: str, dest: Path, ops: list[Op],
              local_name: str = "o<ino>") -> None:  # fmt: skip
        staging.keep_contents()
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=staging.fd)  # fmt: skip
        with os.fdopen(fd, "w") as f:
            json.dump({"dest": str(dest), "local_name": local_name,
                       "ops": [op.to_json() for op in ops]}, f, indent=1)  # fmt: skip

    def _close_staging(self, staging: StagingDir) -> None:
        """However the daemon ends (an exception too): what did not land is kept."""
        if self.lander is not None and self.lander.journal:
            try:
                self._keep(staging, "journal.json", self.dest, list(self.lander.journal))
            except OSError as e:
                staging.keep_contents()
                log.error("journal.json not written in %s: %s", staging.path, e.strerror)
        rep = self.replicas
        if rep is not None and rep.holding and (staging.keep or rep.failed):
            try:  # a dead or slow partner's copies, and where they belong
                self._keep(staging, "held.json", Path(rep.owner_dest), rep.holding,
                           local_name=f"r{rep.owner}-<seq>")  # fmt: skip
            except OSError as e:
                staging.keep_contents()
                log.error("held.json not written in %s: %s", staging.path, e.strerror)
        if not staging.keep and self.tree is not None:
            for name in os.listdir(staging.fd):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.stat(name, dir_fd=staging.fd,
                                            follow_symlinks=False).st_mode):  # fmt: skip
                        os.unlink(name, dir_fd=staging.fd)
        staging.close()

    def _unmount(self) -> None:
        if self._mounted:
            self._mounted = False
            if self._front:
                self._front = False
                _stop_front()
            fuse_ops.unmount()

    async def _serve(self) -> None:
        assert self.lander is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(self._watch_signals)
            nursery.start_soon(self.lander.run)
            if self.replicas is not None:
                await nursery.start(self.replicas.run)
            self.phase = "serving"
            await fuse_ops.serve()
            self.phase = "draining"
            self._unmount()
            assert self.ops is not None
            self.ops.put_settled()  # closed, their RELEASE not seen
            with trio.move_on_after(self.cfg.drain) as self._drain_scope:
                self.lander.poke()
                await self.lander.wait_landed(self.lander.enqueued)
            if self.replicas is not None:
                left = self.lander.enqueued - self.lander.landed
                with trio.CancelScope() as self._drain_scope:
                    await self.replicas.finish(self.cfg.drain, not left, self.lander.landed)
                if not left and self.replicas.partner in self.replicas.dead:
                    self.lander.forget_marker()  # no partner left to read it (or remove it)
            self.phase = "closing"
            nursery.cancel_scope.cancel()

    async def _watch_signals(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            task_status.started()
            if self.stop_signal:
                fuse_ops.terminate()
            async for signum in signals:
                if not self.stop_signal:
                    self.stop_signal = signum
                    log.info(
                        "%s: unmounting, then landing what is left", signal.Signals(signum).name
                    )
                if self.phase == "serving":
                    fuse_ops.terminate()
                elif self.phase == "draining":
                    self._drain_scope.cancel()  # a second signal: stop waiting, keep the rest


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- the front: C threads answering WRITEs (fanfs/csrc/front.c, writes.c) ----------------------
# One thread takes requests (a WRITE costs it a buffer swap and an answer); its writer thread
# does the pwrites. Polling the device after a request (spin) did not help writes: no spin.
FRONT_THREADS = 1


def _start_front(stack: contextlib.ExitStack) -> bool:
    """Let the front's C threads answer WRITEs (after the mount); False (and a warning) if
    they cannot: pyfuse3 then reads every request itself."""
    if fuse_ops.RECEIVER is None:
        return False
    install, session_fd = fuse_ops.RECEIVER
    try:
        lib.front_writes(True)
        ready = lib.front_start(session_fd(), FRONT_THREADS, 0)
    except OSError as e:
        log.warning("front threads unavailable, writes go through the event loop: %s", e)
        return False
    stack.callback(lib.front_close)  # after trio is done with the receiver's fd
    install(lib.receiver(), ready)
    return True


def _stop_front() -> None:
    """Before the unmount: pyfuse3 reads the device again, the threads stop."""
    assert fuse_ops.RECEIVER is not None
    fuse_ops.RECEIVER[0](None, -1)
    lib.front_stop()


def _front_written() -> int:
    """Bytes the front wrote."""
    return int(lib.front_written())
