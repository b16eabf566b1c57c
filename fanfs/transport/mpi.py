"""The MPI transport: remote reads in one round trip. The only module that imports mpi4py.

Protocol (point-to-point on a duplicate of COMM_WORLD, buffer API, no pickle on the data path):
- request, tag 1: four int64 `(entry, offset, length, reply_tag)`, 32 bytes;
- reply, tag `reply_tag`: the stored bytes (still compressed) in chunks under 2 GiB, or one
  empty message when the owner cannot serve them. The requester knows `length` from its own
  catalog, so it posts the receive before asking: no size message, no probe;
- bye, tag 2: "I have unmounted". A daemon stops serving only when every peer said bye or is
  found dead, so no peer loses its source while it still reads.
Reply tags cycle through [16, TAG_UB) and are never reused while a fetch is outstanding.

Concurrency: one thread (`fanfs-mpi`) makes every MPI call after start-up. Trio tasks hand it
commands through a thread-safe queue; it answers with `TrioToken.run_sync_soon`, which never
blocks the MPI thread. The thread blocks on the queue with a timeout that backs off from 50 us
to 1 ms while idle: a blocking Recv would burn a core, and on 2-core nodes that matters.
After start-up no collective operation is used, so a dead rank can only cost its own
requests a peer timeout, after which it is routed around.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from fanfs.transport import PeerTimeout, PeerTransport, ServeFn

log = logging.getLogger(__name__)

TAG_REQUEST = 1
TAG_BYE = 2
FIRST_REPLY_TAG = 16
CHUNK = 1 << 30  # MPI counts are C ints: larger payloads go as several messages
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3


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


def parse_request(header: Any, tag_ub: int) -> tuple[int, int, int, int] | None:
    """(entry, offset, length, reply tag) of a peer's request header, or None if it is not a
    well-formed one (the bytes come from another process and are checked like input). The
    entry and range are checked later against the catalog by the serving side; entry -1 with
    length 0 is a ping."""
    try:
        entry, offset, length, tag = (int(x) for x in header)
    except (TypeError, ValueError):
        return None
    if not FIRST_REPLY_TAG <= tag < tag_ub or offset < 0 or length < 0 or entry < -1:
        return None
    return entry, offset, length, tag


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
        self.comm.Free()
        self.MPI.Finalize()


@dataclass
class _Fetch:
    peer: int
    length: int
    buf: bytearray
    event: trio.Event = field(default_factory=trio.Event)
    count: int = -1  # bytes received; -1: failed


class MpiTransport(PeerTransport):
    def __init__(self, world: World, peer_timeout: float, serve_fn: ServeFn | None = None):
        super().__init__(world.rank, world.size, peer_timeout)
        self.MPI = world.MPI
        self.comm = world.comm
        self.serve_fn = serve_fn
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._tag_ub = int(self.comm.Get_attr(self.MPI.TAG_UB) or 32767)
        self._next_tag = FIRST_REPLY_TAG
        self._outstanding: dict[int, _Fetch] = {}
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    # -- trio side -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peers until cancelled; `started` once the MPI thread runs."""
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._thread = threading.Thread(target=self._loop, name="fanfs-mpi", daemon=True)
            self._thread.start()
            task_status.started()
            await trio.sleep_forever()

    def _tag(self) -> int:
        while True:
            tag = self._next_tag
            self._next_tag = tag + 1 if tag + 1 < self._tag_ub else FIRST_REPLY_TAG
            if tag not in self._outstanding:
                return tag

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        if peer in self._dead:
            raise PeerTimeout(f"rank {peer} is dead")
        tag = self._tag()
        job = _Fetch(peer, length, bytearray(length))
        self._outstanding[tag] = job
        header = np.array([entry, offset, length, tag], dtype=np.int64)
        began = time.perf_counter()
        self._cmds.put(("fetch", peer, tag, header, job))
        try:
            with trio.move_on_after(self.peer_timeout):
                await job.event.wait()
        finally:
            if not job.event.is_set():
                self._cmds.put(("cancel", tag))
            del self._outstanding[tag]
        if not job.event.is_set():
            raise self._timed_out(peer)
        if job.count < 0:
            self._mark_dead(peer, "cannot be reached")
            raise PeerTimeout(f"rank {peer} cannot be reached")
        if job.count != length:
            return None
        self._fetched(began, length, time.perf_counter())
        return bytes(job.buf) if length <= CHUNK else job.buf  # type: ignore[return-value]

    def _deliver(self, job: _Fetch, count: int) -> None:
        job.count = count
        job.event.set()

    def _on_request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._answer, peer, entry, offset, length, tag)

    async def _answer(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        self._cmds.put(("reply", peer, tag, await self._serve_request(peer, entry, offset, length)))

    def _say_bye(self) -> None:
        self._cmds.put(("bye",))

    def stop(self) -> None:
        self._cmds.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the MPI thread --------------------------------------------------------------------

    def _call_trio(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception:
            # Not expected (MPI errors are handled where they happen); should it happen, peers
            # route around this daemon after their peer timeout and our fetches fall back.
            log.exception("the MPI thread failed: remote reads now go to the image")

    def _serve(self) -> None:
        MPI, comm = self.MPI, self.comm
        header = np.empty(4, dtype=np.int64)
        bye = np.empty(1, dtype=np.int64)
        status = MPI.Status()
        incoming = comm.Irecv(header, MPI.ANY_SOURCE, TAG_REQUEST)
        byes = comm.Irecv(bye, MPI.ANY_SOURCE, TAG_BYE)
        receiving: dict[int, list[Any]] = {}  # reply tag -> [requests, fetch, first count]
        sending: list[tuple[Any, Any]] = []  # (request, buffer kept alive until sent)
        cancelled: list[Any] = []
        idle = POLL_MIN_S
        while True:
            busy = False
            try:
                cmd = self._cmds.get(timeout=idle)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                busy = True
                if cmd[0] == "stop":
                    for req in (incoming, byes, *cancelled):
                        req.Cancel()
                    return
                self._command(cmd, receiving, sending, cancelled)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            while (got := self._arrived(incoming, status, "request")) is not False:
                busy = True
                request = parse_request(header, self._tag_ub) if got else None
                if request is not None:
                    self._call_trio(self._on_request, status.Get_source(), *request)
                elif got:
                    self.malformed += 1
                    log.warning("malformed request from rank %d ignored", status.Get_source())
                incoming = comm.Irecv(header, MPI.ANY_SOURCE, TAG_REQUEST)
            while (got := self._arrived(byes, status, "bye")) is not False:
                busy = True
                if got:
                    self._byes.add(status.Get_source())
                byes = comm.Irecv(bye, MPI.ANY_SOURCE, TAG_BYE)
            for tag, rec in list(receiving.items()):
                reqs, job, first = rec
                try:
                    if first is None:
                        if not reqs[0].Test(status):
                            continue
                        first = rec[2] = status.Get_count(MPI.BYTE)
                    if first < min(job.length, CHUNK):  # a short first message: a refusal
                        for req in reqs[1:]:
                            req.Cancel()
                            cancelled.append(req)
                    elif not MPI.Request.Testall(reqs[1:]):
                        continue
                    count = job.length if first >= min(job.length, CHUNK) else first
                except MPI.Exception as e:  # e.g. a reply longer than asked for: not this peer
                    log.warning("bad reply from rank %d: %s", job.peer, e)
                    count = -1
                busy = True
                del receiving[tag]
                self._call_trio(self._deliver, job, count)
            sending = [(req, buf) for req, buf in sending if not self._done(req)]
            cancelled = [req for req in cancelled if not self._done(req)]
            idle = POLL_MIN_S if busy else min(idle * 2, POLL_MAX_S)

    def _arrived(self, req: Any, status: Any, what: str) -> bool | None:
        """Whether a posted receive of requests or byes completed: True, False, or None when
        it completed with an error (a peer sent a message of the wrong size), which is
        counted as malformed and dropped. The caller posts a new receive unless False."""
        try:
            return bool(req.Test(status))
        except self.MPI.Exception as e:
            self.malformed += 1
            log.warning("malformed %s from a peer dropped: %s", what, e)
            return None

    def _done(self, req: Any) -> bool:
        try:
            return bool(req.Test())
        except self.MPI.Exception as e:
            log.warning("MPI send failed: %s", e)
            return True

    def _command(
        self,
        cmd: tuple[Any, ...],
        receiving: dict[int, list[Any]],
        sending: list[tuple[Any, Any]],
        cancelled: list[Any],
    ) -> None:
        comm, kind = self.comm, cmd[0]
        try:
            if kind == "fetch":
                _, peer, tag, header, job = cmd
                if job.length == 0:  # a ping: the empty reply needs a receive all the same
                    reqs = [comm.Irecv(bytearray(1), peer, tag)]
                else:
                    view = memoryview(job.buf)
                    reqs = [comm.Irecv(view[off : off + CHUNK], peer, tag)
                            for off in range(0, job.length, CHUNK)]  # fmt: skip
                receiving[tag] = [reqs, job, None]
                sending.append((comm.Isend(header, peer, TAG_REQUEST), header))
            elif kind == "cancel":
                entry = receiving.pop(cmd[1], None)
                if entry is not None:
                    for req in entry[0]:
                        req.Cancel()
                        cancelled.append(req)
            elif kind == "reply":
                _, peer, tag, data = cmd
                if data is None:
                    sending.append((comm.Isend([b"", self.MPI.BYTE], peer, tag), None))
                else:
                    view = memoryview(data)
                    for off in range(0, len(view), CHUNK):
                        sending.append((comm.Isend(view[off : off + CHUNK], peer, tag), data))
            elif kind == "bye":
                me = np.array([self.rank], dtype=np.int64)
                for peer in range(self.size):
                    if peer != self.rank and peer not in self._dead:
                        sending.append((comm.Isend(me, peer, TAG_BYE), me))
        except self.MPI.Exception as e:
            peer = cmd[1] if kind in ("fetch", "reply") else -1
            log.warning("MPI %s to rank %d failed: %s", kind, peer, e)
            if kind == "fetch":
                receiving.pop(cmd[2], None)
                self._call_trio(self._deliver, cmd[4], -1)
