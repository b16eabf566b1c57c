"""The MPI world of a fanfs job: start-up collectives for the daemon, work messages for
prepare. The only module that imports mpi4py; `mpi.py` talks MPI through the `World` it is
given.

Concurrency: a `World` is used from one thread at a time: the main thread during start-up
(daemon) or the whole run (prepare); after the daemon's start-up only its MPI thread uses the
duplicate communicator, and no collective runs again (a dead rank must not block one).
"""

from __future__ import annotations

import time
from typing import Any

CHUNK = 1 << 30  # MPI counts are C ints: larger payloads go as several messages
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
    from mpi4py import MPI

    return MPI


def launched_size(environ: dict[str, str]) -> int:
    """World size announced by an MPI launcher (mpirun, srun --mpi=pmix), or 1 without one."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        return int(environ["SLURM_STEP_NUM_TASKS"])
    return 1


def join(environ: dict[str, str]) -> World | None:
    """The job's World when an MPI launcher started this process with more than one rank,
    else None; MountFailed when the MPI library cannot serve fanfs."""
    from fanfs import logs
    from fanfs.errors import MountFailed

    if launched_size(environ) <= 1:
        return None
    try:
        world = World()
    except RuntimeError as e:
        raise MountFailed(str(e)) from None
    logs.set_rank(world.rank, world.size)
    return world


class World:
    """COMM_WORLD for start-up collectives (main thread, before the transport thread starts)."""

    def __init__(self) -> None:
        MPI = _mpi()
        self.MPI = MPI
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "the MPI library gives thread level "
                f"{provided}; fanfs needs MPI_THREAD_SERIALIZED or better"
            )
        self.comm = MPI.COMM_WORLD.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self._posted: list[Any] = []  # requests of `post`, until they complete
        # The data plane's communicator (fanfs/csrc/plane.c), which its C thread alone uses:
        # another thread makes MPI calls then, which MPI allows only at THREAD_MULTIPLE. Every
        # rank makes it (a collective) whether or not its plane runs.
        self.plane_comm: Any = None
        if provided >= MPI.THREAD_MULTIPLE:
            self.plane_comm = MPI.COMM_WORLD.Dup()
            self.plane_comm.Set_errhandler(MPI.ERRORS_RETURN)

    def plane_handles(self) -> tuple[int, int, str] | None:
        """(communicator, MPI_BYTE, a loaded library whose dependencies hold MPI's functions)
        for the data plane, or None when MPI cannot give it a communicator of its own."""
        if self.plane_comm is None:
            return None
        MPI = self.MPI
        return MPI._handleof(self.plane_comm), MPI._handleof(MPI.BYTE), MPI.__file__

    def bcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (buffer API, chunked)."""
        n = self.comm.bcast(len(data) if data is not None else 0, root=0)
        buf = bytearray(data) if self.rank == 0 and data is not None else bytearray(n)
        view = memoryview(buf)
        for off in range(0, n, CHUNK):
            self.comm.Bcast(view[off : off + CHUNK], root=0)
        return bytes(buf)

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def allgather(self, obj: Any) -> list[Any]:
        result: list[Any] = self.comm.allgather(obj)
        return result

    # Point-to-point messages of picklable objects, for `fanfs prepare` across ranks.

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
        if self.plane_comm is not None:
            from fanfs.native import lib

            lib.plane_stop()  # (stopped by the transport already, unless it failed first)
            self.plane_comm.Free()
        self.comm.Free()
        self.MPI.Finalize()
