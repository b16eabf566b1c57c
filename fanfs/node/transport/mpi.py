"""The MPI transport: remote reads in one round trip, over the `World` of fanfs/world.py.

The protocol and how messages are taken (never into a buffer sized in advance): inbox.py. This
daemon's fetches and batches, handed to the MPI thread as commands: asks.py. How peers'
requests and batches are answered: answer.py. The front's fetches (READs of files only peers
hold answered without the event loop): front.py.

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
matters), or to 100 ms where the data plane runs and wakes it for a message (POLL_WATCHED_S:
idle, with the plane's own quiet sleeps, the daemon then uses under 1 % of a core here,
against 4-5 %). After start-up no collective operation is used, so a dead rank can only cost
its own requests a peer timeout, after which it is routed around.

The data plane (fanfs/csrc/plane.c), where MPI gives it a communicator of its own (THREAD_MULTIPLE)
and FANFS_PLANE is not 0, takes the front's fetches and answers peers' asks for them in C,
in a thread of its own: this thread then fetches only what the plane hands back (front.py)
and what Python asks for (the planner's batches, the event loop's fetches), answers those,
records the plane's fetches with its own (`_plane_fetched`), and tells it which peers are
dead.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import queue
import select
import threading
import time
from typing import Any

import numpy as np
import trio

from fanfs.native import lib
from fanfs.node.transport import Served
from fanfs.node.transport.answer import REPLY_BYTES, Answers  # noqa: F401 (tests read it here)
from fanfs.node.transport.asks import MpiFetches
from fanfs.node.transport.commands import Bye, Cancel, Command, Outgoing, Reply, Send, Stop
from fanfs.node.transport.front import FrontFetches
from fanfs.node.transport.inbox import (  # noqa: F401 (the tests read the constants here)
    FIRST_REPLY_TAG,
    MAX_REQUEST,
    QUARANTINE_TIMEOUTS,
    TAG_BYE,
    TAG_REQUEST,
    Fetch,
    Inbox,
)
from fanfs.status import PeerStatus
from fanfs.threads import name_os_thread
from fanfs.world import CHUNK, World, leave_to_mpi

log = logging.getLogger(__name__)

POLL_MIN_S = 20e-6
POLL_MAX_S = 2e-3
# ... up to this once idle, where the data plane watches this thread's communicator and wakes
# it for a message (each turn costs tens of microseconds of Python: at 2 ms that was 3-4 % of
# a core per idle daemon).
POLL_WATCHED_S = 0.1
# While a fetch of ours is outstanding the thread spins, but only this long after anything last
# happened: a small file's round trip fits in it, while a slow one (a large frame read from the
# owner's disk) does not burn a core for milliseconds; it is noticed within a 20 us poll.
SPIN_S = 300e-6
# After any traffic the thread polls at POLL_MIN_S for this long before backing off: during an
# epoch requests and replies keep coming, and a back-off to 1 ms put up to a millisecond of
# waiting on each side of every round trip.
HOT_S = 20e-3
# The data plane hands a fetch back to this thread when its holder has not answered within
# this (or half the peer timeout): this thread then asks it again and the other holders, and
# hedges and times it out as it does its own fetches; the plane keeps the reply tag
# quarantined for QUARANTINE_TIMEOUTS peer timeouts.
PLANE_HAND_BACK_S = 0.1
PR_SET_TIMERSLACK = 29  # linux/prctl.h
TIMER_SLACK_NS = 1000


def _precise_timeouts() -> None:
    """Let this thread's short waits end on time: Linux adds a "timer slack" of 50 us to every
    timed wait so that wake-ups can be batched, which made a 50 us poll last 120 us here (73 us
    with 1 us of slack, most of the rest being the wake-up itself). And name it for the system
    (`fanfs bench --calibrate`, top, perf tell it from the daemon's other threads)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    name_os_thread("fanfs-mpi")


class MpiTransport(MpiFetches):
    def __init__(
        self,
        world: World,
        peer_timeout: float,
        server: Served,
        front: FrontFetches | None = None,
        plane: bool = True,
    ):
        """`front`: the front's fetches of peers' files, which the MPI thread takes on
        (front.py); None: READs of peers' files go to Python. `plane`: start the data plane
        where it can run."""
        super().__init__(world.rank, world.size, peer_timeout, server,
                         int(world.comm.Get_attr(world.MPI.TAG_UB) or 32767))  # fmt: skip
        # Written with every command (and by the front): the MPI thread waits on it.
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.MPI = world.MPI
        self.comm = world.comm
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # The parts the MPI thread is handed: the server side and the front's fetches.
        self.answers = Answers(server, self._post, self._call_trio, self._serve_request)
        self.front = front
        self._plane = world.plane_handles() if plane and lib.plane_built() else None
        self.plane_on = False  # the data plane runs (set by the MPI thread, once)
        self._plane_seen = 0  # its fetches recorded so far (`_plane_fetched`)

    @property
    def hedged(self) -> int:
        mine = self.front.hedged if self.front is not None else 0
        return mine + (lib.plane_stats()["hedged"] if self.plane_on else 0)

    @property
    def hedges_won(self) -> int:
        mine = self.front.hedges_won if self.front is not None else 0
        return mine + (lib.plane_stats()["hedges_won"] if self.plane_on else 0)

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

    def _delivered(self, job: Fetch, count: int) -> None:
        """(The MPI thread.) Wake whoever waits for `job`: a thread at once, a task through
        the event loop, the front's READ through the C."""
        if job.native is not None:
            assert self.front is not None
            self.front.done(job, count)
        else:
            super()._delivered(job, count)

    def _say_bye(self) -> None:
        self._post(Bye())

    def budget(self) -> dict[str, int]:
        budget = self.answers.budget()
        if self.plane_on:  # the plane's answers
            p = lib.plane_stats()
            budget["owner_n"] += p["owner_n"]
            budget["owner_queue_ns"] += p["owner_queue_ns"]
            budget["owner_read_ns"] += p["owner_read_ns"]
            budget["owner_post_ns"] += p["owner_post_ns"]
        return budget

    def statistics(self) -> PeerStatus:
        if not self.plane_on:
            return super().statistics()
        self._plane_fetched()  # (the plane's fetches are counted before its READs are answered)
        s = super().statistics()
        p = lib.plane_stats()
        return dataclasses.replace(
            s,
            served_to_peers=s.served_to_peers + p["answered"],
            served_without_event_loop=s.served_without_event_loop + p["answered"],
            bytes_served_to_peers=s.bytes_served_to_peers + p["answered_bytes"],
            refused_to_peers=s.refused_to_peers + p["refused"],
            malformed_messages=s.malformed_messages + p["malformed"],
            plane_fetches=p["filled"],
            plane_handed_back=p["handed_back"],
            plane_left=p["left"],
        )

    def mark_dead(self, peer: int, why: str) -> None:
        super().mark_dead(peer, why)
        if self.plane_on:
            lib.plane_dead(peer)

    def stop(self) -> None:
        self.answers.stop()
        self._post(Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.plane_on:  # (after the MPI thread: what it handed back went to Python)
            lib.plane_stop()

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
            self._start_plane()
            self._serve()
        except Exception:
            # Not expected (MPI errors are handled where they happen); should it happen, peers
            # route around this daemon after their peer timeout and our fetches fall back.
            log.exception("the MPI thread failed: remote reads now go to the image")
        finally:
            if self.front is not None:  # every READ waiting for a peer goes to Python
                self.front.stop()

    def _start_plane(self) -> None:
        """(The MPI thread, once.) Start the data plane, if it can run; else this thread
        does its work."""
        if self._plane is None:
            return
        comm, byte, library = self._plane
        hand_back = min(PLANE_HAND_BACK_S, self.peer_timeout / 2)
        try:
            lib.plane_start(comm, byte, library, self.rank, self.size, self._tag_ub,
                            self.front is not None, hand_back, self.hedge_delay(),
                            QUARANTINE_TIMEOUTS * self.peer_timeout,
                            self.MPI._handleof(self.comm), self._wake)  # fmt: skip
        except OSError as e:
            log.warning("the data plane did not start (%s): the MPI thread does its work", e)
            return
        self.plane_on = True  # (first: a peer found dead from now on is passed on at once)
        self.plane_fetches = self.front is not None  # (else it only answers peers)
        for peer in self.dead:
            lib.plane_dead(peer)

    def _plane_fetched(self) -> None:
        """Record the data plane's fetches filled since the last call, as the MPI thread's own
        are (their latency, their bytes): each turn of the MPI thread, and before a status."""
        with self._lock:
            self._plane_seen, done = lib.plane_latencies(self._plane_seen)
            for seconds, length in done:
                self._record(seconds, length)
        if done:
            lib.plane_hedge(self.hedge_delay())

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
        longest = POLL_WATCHED_S if self.plane_on else POLL_MAX_S  # (started: _loop)
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
            if self.plane_on:
                self._plane_fetched()
            now = time.monotonic()
            kept = []
            for out in sending:
                if self._done(out.req):
                    self.answers.sent(out.reserved)
                elif out.peer in self._dead and now - out.at > self.peer_timeout:
                    # Its peer died: it may never end (Open MPI 4). Its bytes no longer count
                    # against the budget (else a dead requester could hold all of it); its
                    # buffer is kept for MPI, for good.
                    self.answers.sent(out.reserved)
                    leave_to_mpi(out.req, out.buf)
                else:
                    kept.append(out)
            sending[:] = kept
            # (A quarantined tag's late reply is not waited for hot: a dead peer's never comes.)
            if busy or sending or inbox.waiting():
                hot_until = now + HOT_S
            if busy:
                moved = now
            # A reader waits for one of our fetches (not only the planner's threads, which
            # want throughput and can wait a poll): no sleep at all.
            if now - moved < SPIN_S and inbox.readers_waiting() and not lib.cpu_pressed():
                idle = 0.0
            else:
                idle = POLL_MIN_S if now < hot_until else min(max(idle, POLL_MIN_S) * 2, longest)

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

        def send(data: Any, peer: int, tag: int, keep: Any, reserved: int = 0) -> None:
            """Post a send; `keep` (what `data` views) lives until it is done."""
            req = comm.Isend(data, peer, tag)
            sending.append(Outgoing(req, keep, reserved, peer, time.monotonic()))

        try:
            if isinstance(cmd, Send):
                inbox.expect(cmd.tag, cmd.job)
                send(cmd.header, cmd.peer, cmd.kind, cmd.header)
            elif isinstance(cmd, Cancel):
                inbox.forget(cmd.tag)
            elif isinstance(cmd, Reply):
                self._count_reply(cmd.entry, cmd.data, cmd.direct, cmd.files)
                # What the server side reserved for it is released once its last part is sent.
                if cmd.data is None:
                    send([b"", self.MPI.BYTE], cmd.peer, cmd.tag, None, cmd.reserved)
                else:
                    view = memoryview(cmd.data)
                    for off in range(0, len(view), CHUNK):
                        last = off + CHUNK >= len(view)
                        send(view[off : off + CHUNK], cmd.peer, cmd.tag, cmd.data,
                             cmd.reserved if last else 0)  # fmt: skip
                    self.answers.posted(cmd)
            elif isinstance(cmd, Bye):
                me = np.array([self.rank], dtype=np.int64)
                for peer in range(self.size):
                    if peer != self.rank and peer not in self._dead:
                        send(me, peer, TAG_BYE, me)
        except self.MPI.Exception as e:
            peer = cmd.peer if isinstance(cmd, (Send, Reply)) else -1
            log.warning("MPI %s to rank %d failed: %s", type(cmd).__name__, peer, e)
            if isinstance(cmd, Send):
                inbox.drop(cmd.tag)
                self._delivered(cmd.job, -1)
            elif isinstance(cmd, Reply):
                self.answers.sent(cmd.reserved)
