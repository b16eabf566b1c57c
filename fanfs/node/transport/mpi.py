"""The MPI transport: remote reads in one round trip, over the `World` of fanfs/world.py.

The protocol and how messages are taken (never into a buffer sized in advance): inbox.py. How
peers' requests and batches are answered: answer.py. The front's fetches (`native_remote`,
READs of files only peers hold answered without the event loop): front.py.

Concurrency: one thread (`fanfs-mpi`) makes every MPI call after start-up (NoPFS's model); the
server side (answer.py) and the front's fetches (front.py) are objects handed to it. Trio tasks
and threads hand it commands (commands.py) through a thread-safe queue and an eventfd; it
answers with `TrioToken.run_sync_soon`, which never blocks the MPI thread (the planner's
threads, which fetch with `fetch_blocking`, are woken directly). While a fetch that a reader
waits for is outstanding it polls without sleeping (yielding the CPU between polls) for up to
SPIN_S after the last event: a sleep of even 50 us added a tenth of a millisecond to every
remote file (see docs/performance.md); but not while the kernel says threads wait for a CPU
(`lib.cpu_pressed`), when the spin takes a core from the readers and the other daemons of the
node. Otherwise it blocks on the queue with a timeout: 20 us for HOT_S after any traffic,
backing off to 2 ms once idle (a blocking Recv would burn a core, and on 2-core nodes that
matters; idle, a daemon uses about 1 % of one). A planner's batch (`fetch_batch_blocking`: the
whole stored bytes of up to BATCH_MAX files in one round trip) is this daemon's fetch like any
other, with one reply. After start-up no collective operation is used, so a dead rank can only
cost its own requests a peer timeout, after which it is routed around.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from fanfs.native import lib
from fanfs.node.transport import PeerTimeout, PeerTransport, Served
from fanfs.node.transport.answer import REPLY_BYTES as REPLY_BYTES  # (tests read it here)
from fanfs.node.transport.answer import Answers
from fanfs.node.transport.commands import Bye, Cancel, Command, Outgoing, Reply, Send, Stop
from fanfs.node.transport.front import FrontFetches
from fanfs.node.transport.inbox import (
    BATCH_MAX,
    MAX_REQUEST,
    TAG_BATCH,
    TAG_BYE,
    TAG_REQUEST,
    Fetch,
    Inbox,
    ReplyTags,
    batch_header,
    request_header,
)
from fanfs.node.transport.inbox import (
    FIRST_REPLY_TAG as FIRST_REPLY_TAG,  # (tests read it here)
)
from fanfs.world import CHUNK, World

log = logging.getLogger(__name__)

POLL_MIN_S = 20e-6
POLL_MAX_S = 2e-3
# While a fetch of ours is outstanding the thread spins, but only this long after anything last
# happened: a small file's round trip fits in it, while a slow one (a large frame read from the
# owner's disk) does not burn a core for milliseconds; it is noticed within a 20 us poll.
SPIN_S = 300e-6
# After any traffic the thread polls at POLL_MIN_S for this long before backing off: during an
# epoch requests and replies keep coming, and a back-off to 1 ms put up to a millisecond of
# waiting on each side of every round trip.
HOT_S = 20e-3
PR_SET_TIMERSLACK = 29  # linux/prctl.h
PR_SET_NAME = 15
TIMER_SLACK_NS = 1000


def _precise_timeouts() -> None:
    """Let this thread's short waits end on time: Linux adds a "timer slack" of 50 us to every
    timed wait so that wake-ups can be batched, which made a 50 us poll last 120 us here (73 us
    with 1 us of slack, most of the rest being the wake-up itself). And name it for the system
    (`fanfs bench --calibrate`, top, perf tell it from the daemon's other threads)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(b"fanfs-mpi"), 0, 0, 0)


class MpiTransport(PeerTransport):
    blocking_fetch = True
    batches = True

    def __init__(
        self,
        world: World,
        peer_timeout: float,
        server: Served,
        front: FrontFetches | None = None,
    ):
        """`front`: the front's fetches of peers' files, which the MPI thread takes on
        (front.py); None: READs of peers' files go to Python."""
        super().__init__(world.rank, world.size, peer_timeout, server)
        # Written with every command (and by the front): the MPI thread waits on it.
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.MPI = world.MPI
        self.comm = world.comm
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._tag_ub = int(self.comm.Get_attr(self.MPI.TAG_UB) or 32767)
        self._tags = ReplyTags(self._tag_ub)
        self._lock = threading.Lock()  # counters: the event loop and threads
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # The parts the MPI thread is handed: the server side and the front's fetches.
        self.answers = Answers(server, self._post, self._call_trio, self._serve_request)
        self.front = front

    @property
    def hedged(self) -> int:
        return self.front.hedged if self.front is not None else 0

    @property
    def hedges_won(self) -> int:
        return self.front.hedges_won if self.front is not None else 0

    # -- trio side -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peers until cancelled; `started` once the MPI thread runs."""
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._thread = threading.Thread(target=self._loop, name="fanfs-mpi", daemon=True)
            self._thread.start()
            self.answers.start(nursery)
            task_status.started()
            await trio.sleep_forever()

    def _post(self, cmd: Command) -> None:
        """Queue a command for the MPI thread and wake it (any thread)."""
        self._cmds.put(cmd)
        os.eventfd_write(self._wake, 1)

    def reserve(self) -> int:
        """A reply tag, in use until its reply is taken or drained (any thread)."""
        return self._tags.reserve()

    def fetched(self, began: float, length: int) -> None:
        """A fetch that began at `began` (perf_counter) got its `length` bytes (any thread)."""
        with self._lock:
            self._fetched(began, length, time.perf_counter())

    def _start(self, peer: int, job: Fetch, header: Callable[[int], np.ndarray],
               kind: int = TAG_REQUEST) -> int:  # fmt: skip
        """Hand the MPI thread a fetch (any thread): `header(reply_tag)` sent with MPI tag
        `kind` (a request or a batch); its reply tag."""
        tag = self.reserve()
        self._post(Send(peer, tag, header(tag), job, kind))
        return tag

    def _forget(self, tag: int, done: bool) -> None:
        """A fetch is over: the MPI thread frees its tag once its reply is taken (or drained,
        when the fetch gave up first)."""
        if not done:
            self._post(Cancel(tag))

    def _result(self, peer: int, job: Fetch, done: bool, began: float) -> bytes | None:
        if not self._arrived(peer, job, done):
            return None  # a refusal, or a reply of the wrong size: another source
        self.fetched(began, job.length)
        return bytes(job.buf) if job.length <= CHUNK else job.buf  # type: ignore[return-value]

    def _arrived(self, peer: int, job: Fetch, done: bool) -> bool:
        """Whether all `job` asked for came; PeerTimeout if the peer did not answer."""
        if not done:
            raise self.timed_out(peer)
        if job.count == -1:
            self.mark_dead(peer, "cannot be reached")
            raise PeerTimeout(f"rank {peer} cannot be reached")
        return job.count == job.length

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        if peer in self._dead:
            raise PeerTimeout(f"rank {peer} is dead")
        job = Fetch(peer, length, bytearray(length))
        began = time.perf_counter()
        tag = self._start(peer, job, lambda tag: request_header(entry, offset, length, tag))
        try:
            with trio.move_on_after(self.peer_timeout):
                await job.event.wait()
        finally:  # also when cancelled: the MPI thread must let go of the buffer
            done = job.event.is_set()
            self._forget(tag, done)
        return self._result(peer, job, done, began)

    def fetch_blocking(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        """`fetch` for a thread of the daemon's own (the planner's): blocks, never the MPI
        thread's or the event loop's. PeerTimeout as `fetch`."""
        began = time.perf_counter()
        job, done = self._wait_blocking(
            peer, length, lambda tag: request_header(entry, offset, length, tag)
        )
        return self._result(peer, job, done, began)

    def _wait_blocking(self, peer: int, length: int, header: Callable[[int], np.ndarray],
                       kind: int = TAG_REQUEST) -> tuple[Fetch, bool]:  # fmt: skip
        """Send a request (`_start`) and wait in this thread for its `length` bytes, at most
        the peer timeout: (the fetch, whether it finished)."""
        if peer in self._dead:
            raise PeerTimeout(f"rank {peer} is dead")
        waiter = threading.Event()
        job = Fetch(peer, length, bytearray(length), waiter=waiter)
        tag = self._start(peer, job, header, kind)
        done = waiter.wait(self.peer_timeout)
        self._forget(tag, done)
        return job, done

    def fetch_batch_blocking(self, peer: int, entries: list[int],
                             lengths: list[int]) -> list[memoryview] | None:  # fmt: skip
        """The whole stored bytes of up to BATCH_MAX files `peer` holds, in one round trip
        (`lengths`: their stored lengths, from this daemon's catalog, at most MAX_REQUEST in
        all), for a thread of the daemon's own; None if the peer refused them. PeerTimeout as
        `fetch`. Not checked here (their CRCs are the caller's)."""
        total = sum(lengths)
        if not 1 <= len(entries) == len(lengths) <= BATCH_MAX or total > MAX_REQUEST:
            raise ValueError(f"a batch of {len(entries)} files, {total} bytes")
        job, done = self._wait_blocking(peer, total, lambda tag: batch_header(tag, entries),
                                        TAG_BATCH)  # fmt: skip
        if not done:  # a slow owner is not a dead one: the files are asked for one by one
            raise PeerTimeout(f"rank {peer} did not answer a batch in time")
        if not self._arrived(peer, job, done):
            return None
        with self._lock:
            self.fetch_bytes += total
            self.batch_fetches += 1
            self.batched_files += len(entries)
        view, out, at = memoryview(job.buf), [], 0
        for n in lengths:
            out.append(view[at : at + n])
            at += n
        return out

    def _delivered(self, job: Fetch, count: int) -> None:
        """(The MPI thread.) Wake whoever waits for `job`: a thread at once, a task through
        the event loop, the front's READ through the C."""
        if job.native is not None:
            assert self.front is not None
            self.front.done(job, count)
        elif job.waiter is not None:
            job.finish(count)
        else:
            self._call_trio(job.finish, count)

    def _say_bye(self) -> None:
        self._post(Bye())

    def stop(self) -> None:
        self.answers.stop()
        self._post(Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the MPI thread --------------------------------------------------------------------

    def _call_trio(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _loop(self) -> None:
        _precise_timeouts()
        try:
            if self.front is not None:
                self.front.start(self._wake, self)
            self._serve()
        except Exception:
            # Not expected (MPI errors are handled where they happen); should it happen, peers
            # route around this daemon after their peer timeout and our fetches fall back.
            log.exception("the MPI thread failed: remote reads now go to the image")
        finally:
            if self.front is not None:  # every READ waiting for a peer goes to Python
                self.front.stop()

    def _serve(self) -> None:
        MPI = self.MPI
        bye = np.empty(1, dtype=np.int64)
        status = MPI.Status()
        inbox = Inbox(self.comm, MPI, self.peer_timeout, self._delivered, self._tags.release,
                      self._count_malformed)  # fmt: skip
        sending: list[Outgoing] = []

        def command(cmd: Command) -> None:
            self._command(cmd, inbox, sending)

        idle = POLL_MIN_S
        hot_until = moved = 0.0
        while True:
            busy = False
            # (No exception on an idle turn: they cost more than the rest of it.)
            if select.select([self._wake], [], [], idle)[0]:
                os.eventfd_read(self._wake)
            if self._cmds.empty() and not idle:
                os.sched_yield()  # spinning: let the readers and the event loop run first
            while not self._cmds.empty():  # (this thread is the only one that takes)
                busy = True
                cmd = self._cmds.get_nowait()
                if isinstance(cmd, Stop):
                    inbox.close([(out.req, out.buf) for out in sending])
                    return
                command(cmd)
            busy |= self.answers.take(inbox, status, MPI.ANY_SOURCE, self._tag_ub,
                                      self._count_malformed)  # fmt: skip
            while (size := inbox.probe(MPI.ANY_SOURCE, TAG_BYE, status, bye)) is not None:
                busy = True
                if size < 0:
                    break
                if size == bye.nbytes:
                    self._byes.add(status.Get_source())
                else:
                    self._count_malformed()
            busy |= inbox.take_all(status)
            if self.front is not None:
                busy |= self.front.step(inbox, command)
            kept = []
            for out in sending:
                if self._done(out.req):
                    self.answers.sent(out.reserved)
                else:
                    kept.append(out)
            sending[:] = kept
            now = time.monotonic()
            if busy or inbox.receiving:
                hot_until = now + HOT_S
            if busy:
                moved = now
            # A reader waits for one of our fetches (not only the planner's threads, which
            # want throughput and can wait a poll): no sleep at all.
            if now - moved < SPIN_S and inbox.readers_waiting() and not lib.cpu_pressed():
                idle = 0.0
            else:
                idle = POLL_MIN_S if now < hot_until else min(max(idle, POLL_MIN_S) * 2, POLL_MAX_S)

    def _count_malformed(self) -> None:
        self.malformed += 1

    def _done(self, req: Any) -> bool:
        try:
            return bool(req.Test())
        except self.MPI.Exception as e:
            log.warning("MPI send failed: %s", e)
            return True

    def _command(self, cmd: Command, inbox: Inbox, sending: list[Outgoing]) -> None:
        comm = self.comm
        try:
            if isinstance(cmd, Send):
                inbox.expect(cmd.tag, cmd.job)
                sending.append(Outgoing(comm.Isend(cmd.header, cmd.peer, cmd.kind), cmd.header, 0))
            elif isinstance(cmd, Cancel):
                inbox.forget(cmd.tag)
            elif isinstance(cmd, Reply):
                self._count_reply(cmd.entry, cmd.data, cmd.direct, cmd.files)
                # What the server side reserved for it is released once its last part is sent.
                if cmd.data is None:
                    sending.append(Outgoing(comm.Isend([b"", self.MPI.BYTE], cmd.peer, cmd.tag),
                                            None, cmd.reserved))  # fmt: skip
                else:
                    view = memoryview(cmd.data)
                    for off in range(0, len(view), CHUNK):
                        last = off + CHUNK >= len(view)
                        isend = comm.Isend(view[off : off + CHUNK], cmd.peer, cmd.tag)
                        sending.append(Outgoing(isend, cmd.data, cmd.reserved if last else 0))
            elif isinstance(cmd, Bye):
                me = np.array([self.rank], dtype=np.int64)
                for peer in range(self.size):
                    if peer != self.rank and peer not in self._dead:
                        sending.append(Outgoing(comm.Isend(me, peer, TAG_BYE), me, 0))
        except self.MPI.Exception as e:
            peer = cmd.peer if isinstance(cmd, (Send, Reply)) else -1
            log.warning("MPI %s to rank %d failed: %s", type(cmd).__name__, peer, e)
            if isinstance(cmd, Send):
                inbox.drop(cmd.tag)
                self._delivered(cmd.job, -1)
            elif isinstance(cmd, Reply):
                self.answers.sent(cmd.reserved)
