"""The MPI world of a fanfs job: start-up collectives for the daemon, work messages for
prepare. The only module that imports mpi4py; `mpi.py` talks MPI through the `World` it is
given.

Concurrency: a `World` is used from one thread at a time: the main thread during start-up
(daemon) or the whole run (prepare); after the daemon's start-up only its MPI thread uses the
duplicate communicator, and no collective runs again (a dead rank must not block one).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fanfs.errors import FanfsError, MountFailed

CHUNK = 1 << 30  # MPI counts are C ints: larger payloads go as several messages
# The most one rank may say in `bcast` or `allgather` (verdicts, names, paths, prepare's
# settings and dictionaries): far above any of them, far below a rank's memory.
MESSAGE_MAX = 64 << 20
# A stop signal during a start-up collective: the others may be on their way to it (all ranks
# then fail together, one clear line); past this the wait ends anyway (a rank may be dead).
STOP_GRACE_S = 5.0
# Transfers given up on (a peer died mid-transfer: Open MPI may never end them), with their
# buffers: MPI may still use them, so they live as long as the process (`leave_to_mpi`).
LEFT_TO_MPI: list[tuple[Any, Any]] = []


def leave_to_mpi(req: Any, buf: Any) -> None:
    """Keep request `req` and its buffer for the life of the process, untested: an mpi4py
    request let go while active frees a buffer MPI may still use."""
    LEFT_TO_MPI.append((req, buf))


def _mpi() -> Any:
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    mpi4py.rc.finalize = False  # fanfs decides: finalizing with a dead peer can hang
    before = _threads()
    from mpi4py import MPI

    # The threads MPI_Init started (Open MPI's progress threads, PMIx's) carry the process's
    # name; named for what they are, `top -H` and `fanfs bench` tell them from fanfs's own.
    for tid in _threads() - before:
        with contextlib.suppress(OSError):
            Path(f"/proc/self/task/{tid}/comm").write_text(MPI_THREADS)
    return MPI


MPI_THREADS = "mpi-progress"


def _threads() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def launched_size(environ: dict[str, str]) -> int:
    """World size announced by an MPI launcher (mpirun, srun --mpi=pmix), or 1 without one."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        return int(environ["SLURM_STEP_NUM_TASKS"])
    return 1


def join(environ: dict[str, str], limit_s: float | None = None,
         stopping: Callable[[], Exception | None] = lambda: None) -> World | None:  # fmt: skip
    """The job's World when an MPI launcher started this process with more than one rank,
    else None; MountFailed when the MPI library cannot serve fanfs. `limit_s` and `stopping`:
    as World's."""
    from fanfs import logs

    if launched_size(environ) <= 1:
        return None
    try:
        world = World(limit_s, stopping)
    except RuntimeError as e:
        raise MountFailed(str(e)) from None
    logs.set_rank(world.rank, world.size)
    return world


class World:
    """COMM_WORLD for start-up collectives (main thread, before the transport thread starts).

    A rank that died or never started leaves every collective unfinished for good (Open MPI
    4 has no way to end one), and its peers used to wait in it for ever, deaf to the stop
    signals (a Python handler runs only between bytecodes), spinning a core each. So every
    collective is begun non-blocking and tested: `limit_s` bounds the wait (None: no bound,
    `fanfs prepare`), and once `stopping()` gives an error the wait goes on STOP_GRACE_S more
    (the others may be on their way) and then raises it. A collective left so is `abandoned`:
    MPI_Finalize would wait for it, so `finalize` does nothing then."""

    def __init__(self, limit_s: float | None = None,
                 stopping: Callable[[], Exception | None] = lambda: None) -> None:  # fmt: skip
        MPI = _mpi()
        self.MPI = MPI
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "the MPI library gives thread level "
                f"{provided}; fanfs needs MPI_THREAD_SERIALIZED or better"
            )
        self.limit_s, self.stopping = limit_s, stopping
        self.abandoned = False
        self.rank: int = MPI.COMM_WORLD.Get_rank()
        self.size: int = MPI.COMM_WORLD.Get_size()
        self.comm = self._dup("joining the job")
        self._posted: list[Any] = []  # requests of `post`, until they complete
        # The data plane's communicator (fanfs/csrc/plane.c), which its C thread alone uses:
        # another thread makes MPI calls then, which MPI allows only at THREAD_MULTIPLE. Every
        # rank makes it (a collective) whether or not its plane runs.
        self.plane_comm: Any = None
        if provided >= MPI.THREAD_MULTIPLE:
            self.plane_comm = self._dup("joining the job")

    def _dup(self, what: str) -> Any:
        comm, req = self.MPI.COMM_WORLD.Idup()
        self._wait(req, what)
        comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        return comm

    def _wait(self, req: Any, what: str, keep: Any = None) -> None:
        """Wait for collective `req` (`keep`: its buffers) within `limit_s` and the stop."""
        began, pause, stop_at = time.monotonic(), 1e-4, 0.0
        while not req.Test():
            now = time.monotonic()
            error = self.stopping()
            if error is not None:
                stop_at = stop_at or now + STOP_GRACE_S
                error = error if now > stop_at else None
            elif self.limit_s is not None and now - began > self.limit_s:
                error = MountFailed(
                    f"rank {self.rank} waited {self.limit_s:g} s for the other ranks at "
                    f"start-up ({what}): one died or never started (the launcher's output "
                    "says which)"
                )
            if error is not None:
                self.abandoned = True
                leave_to_mpi(req, keep)
                raise error
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def plane_handles(self) -> tuple[int, int, str] | None:
        """(communicator, MPI_BYTE, a loaded library whose dependencies hold MPI's functions)
        for the data plane, or None when MPI cannot give it a communicator of its own."""
        if self.plane_comm is None:
            return None
        MPI = self.MPI
        return MPI._handleof(self.plane_comm), MPI._handleof(MPI.BYTE), MPI.__file__

    def bcast_bytes(self, data: bytes | None, limit: int | None = None) -> bytes:
        """Rank 0's `data` on every rank (buffer API, chunked); more than `limit` bytes
        announced: refused before any is allocated."""
        size = bytearray(struct.pack("<q", len(data) if data is not None else 0))
        self._wait(self.comm.Ibcast([size, self.MPI.BYTE], root=0), "rank 0's broadcast", size)
        (n,) = struct.unpack("<q", size)
        _check_size(n, limit, 0)
        try:
            buf = bytearray(data) if self.rank == 0 and data is not None else bytearray(n)
        except MemoryError:
            raise FanfsError(f"rank 0 announced {n} bytes: more than this rank can hold") from None
        view = memoryview(buf)
        for off in range(0, n, CHUNK):
            part = view[off : off + CHUNK]
            self._wait(self.comm.Ibcast([part, self.MPI.BYTE], root=0), "rank 0's broadcast",
                       buf)  # fmt: skip
        return bytes(buf)

    def bcast(self, obj: Any) -> Any:
        """Rank 0's `obj` (JSON's types; a tuple arrives as a list) on every rank."""
        data = _dumps(obj) if self.rank == 0 else None
        return _loads(self.bcast_bytes(data, MESSAGE_MAX), 0)

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON's types; a tuple arrives as a list), in rank order."""
        MPI, data = self.MPI, _dumps(obj)
        mine, sizes = bytearray(struct.pack("<q", len(data))), bytearray(8 * self.size)
        req = self.comm.Iallgather([mine, MPI.BYTE], [sizes, MPI.BYTE])
        self._wait(req, "every rank's verdict", (mine, sizes))
        counts = list(struct.unpack(f"<{self.size}q", sizes))
        for rank, n in enumerate(counts):
            _check_size(n, MESSAGE_MAX, rank)
        displs = [sum(counts[:r]) for r in range(self.size)]
        out = bytearray(max(1, sum(counts)))
        req = self.comm.Iallgatherv([data, MPI.BYTE], [out, (counts, displs), MPI.BYTE])
        self._wait(req, "every rank's verdict", (data, out))
        return [
            _loads(out[d : d + c], r) for r, (c, d) in enumerate(zip(counts, displs, strict=True))
        ]

    # Point-to-point messages of picklable objects, for `fanfs prepare` across ranks: rank 0
    # hands out work and takes back its results (exceptions too) from the job's own ranks.

    def post(self, obj: Any, dest: int, tag: int) -> None:
        """Send without waiting (a blocking send could wait on a peer that is itself sending
        to us); `drain` waits for everything posted."""
        self._posted = [r for r in self._posted if not r.Test()]
        self._posted.append(self.comm.isend(obj, dest=dest, tag=tag))

    def post_bytes(self, data: bytes, dest: int, tag: int) -> None:
        """Send bytes without waiting (buffer API: no pickle, so the receiver checks them as
        data); `in_flight` says how many are still on their way."""
        self._posted = [r for r in self._posted if not r.Test()]
        self._posted.append(self.comm.Isend(bytearray(data), dest=dest, tag=tag))

    def recv_bytes(self, source: int, tag: int, limit: int, timeout: float) -> bytes | None:
        """A waiting message from `source` as bytes, None if none waits. Found by matched
        probe and received into exactly its size: one over `limit` bytes is left unreceived,
        never allocated for, and refused (ValueError). Its receive is waited for at most
        `timeout` s (TimeoutError): a large message's sender killed mid-send leaves it
        unfinished for good (Open MPI), and a blocking receive hung its caller for good; the
        buffer is then kept for MPI, never freed."""
        status = self.MPI.Status()
        msg = self.comm.Improbe(source=source, tag=tag, status=status)
        if msg is None:  # asked again: what this probe moved in, Open MPI matches at the next
            msg = self.comm.Improbe(source=source, tag=tag, status=status)
        if msg is None:
            return None
        n = status.Get_count(self.MPI.BYTE)
        if n > limit:
            raise ValueError(f"a message of {n} bytes, over the limit of {limit}")
        buf = bytearray(max(n, 1))
        req = msg.Irecv([buf, n, self.MPI.BYTE])
        deadline = time.monotonic() + timeout
        while not req.Test():
            if time.monotonic() > deadline:
                leave_to_mpi(req, buf)
                raise TimeoutError(f"a message of {n} bytes from rank {source} did not "
                                   f"arrive within {timeout:g} s")  # fmt: skip
            time.sleep(0.001)
        return bytes(buf[:n])

    def in_flight(self) -> int:
        """Messages posted and not yet delivered (never blocks)."""
        self._posted = [r for r in self._posted if not r.Test()]
        return len(self._posted)

    def drain(self) -> None:
        self.MPI.Request.Waitall(self._posted)
        self._posted = []

    def recv(self, source: int, tag: int) -> Any:
        return self.comm.recv(source=source, tag=tag)

    def pending(self, source: int, tag: int) -> bool:
        """Whether a message from `source` with `tag` is waiting (never blocks)."""
        return bool(self.comm.Iprobe(source=source, tag=tag))

    def abort(self, code: int) -> None:
        """End every rank of the job now (the way out when peers may be blocked on us)."""
        self.comm.Abort(code)

    def finalize(self) -> None:
        if self.abandoned:
            return  # a collective left unfinished: MPI_Finalize would wait for it for ever
        if self.plane_comm is not None:
            from fanfs.native import lib

            lib.plane_stop()  # (stopped by the transport already, unless it failed first)
            self.plane_comm.Free()
        self.comm.Free()
        self.MPI.Finalize()


# The start-up collectives carry data, never code: a peer daemon's messages are checked like
# input (docs/security.md), and unpickling runs whatever a pickle names.
def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False).encode()


def _loads(data: bytes | bytearray, rank: int) -> Any:
    try:
        return json.loads(bytes(data))
    except (ValueError, RecursionError) as e:
        raise FanfsError(
            f"rank {rank} sent a start-up message that is not fanfs's ({len(data)} bytes: {e})"
        ) from None


def _check_size(n: int, limit: int | None, rank: int) -> None:
    if n < 0 or (limit is not None and n > limit):
        raise FanfsError(f"rank {rank} announced a start-up message of {n} bytes")
