"""The MPI transport: remote reads in one round trip, over the `World` of fanfs/world.py.

The protocol and how messages are taken (never into a buffer sized in advance): inbox.py. A
request for more than MAX_REQUEST, or while more than REPLY_BYTES of replies wait for their
requesters, is refused with an empty reply.

Concurrency: one thread (`fanfs-mpi`) makes every MPI call after start-up. Trio tasks hand it
commands through a thread-safe queue; it answers with `TrioToken.run_sync_soon`, which never
blocks the MPI thread (the planner's threads, which fetch with `fetch_blocking`, are woken
directly). While a fetch that a reader waits for is outstanding it polls without sleeping
(yielding the CPU between polls) for up to SPIN_S after the last event: a sleep of even 50 us
added a tenth of a millisecond to every remote file (see docs/performance.md); but not while
the kernel says threads wait for a CPU (`lib.cpu_pressed`), when the spin takes a core from
the readers and the other daemons of the node. Otherwise it
blocks on the queue with a timeout: 20 us for HOT_S after any traffic, backing off to 2 ms once
idle (a blocking Recv would burn a core, and on 2-core nodes that matters; idle, a daemon uses
about 1 % of one). A peer's request that a plain read answers (the server's `locate`) is served
without the event loop: the MPI thread reads what the page cache holds, SERVER_THREADS threads
read the rest from the disk, and both put the reply on the command queue. Other requests
(refusals, large raw files not checked yet) go to the server's `serve` in the event loop.
A planner's batch (`fetch_batch_blocking`: the whole stored bytes of up to BATCH_MAX files in
one round trip) is read by a server thread, or refused whole if one file is not a plain read
here or the reply would pass MAX_REQUEST.
After start-up no collective operation is used, so a dead rank can only cost its own
requests a peer timeout, after which it is routed around.

With `native_remote`, the front's READs of files only peers hold (fanfs/csrc/front.c) never
reach the event loop: the front queues a request for the file's stored bytes and writes the
thread's eventfd, the thread takes it (`lib.remote_take`), asks a live holder, and hands the
reply to the C (`lib.remote_fill`: checked, decoded, the waiting READ answered), all in this
thread. A refusal, a bad copy, a dead or silent holder (after the peer timeout, which this
thread watches itself) sends it to the next holder, and a slow one is hedged: after the hedge
delay another holder is asked too, the first good copy filling the piece (the other's is
ESTALE then); when no holder is left it is given up (`lib.remote_fail`) and the READ goes to
Python, which also tries the image. So that a silent peer cannot freeze the mount, at most
NATIVE_WAITING of the front's READs wait for peers at once (one front thread is always left
for local files; the others go to Python's event loop at once), each at most the peer timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from fanfs.native import lib
from fanfs.node.pool import THREADS as FRONT_THREADS
from fanfs.node.transport import PeerTimeout, PeerTransport, Served
from fanfs.node.transport.inbox import (
    BATCH_HEADER,
    BATCH_MAX,
    FIRST_REPLY_TAG,
    MAX_REQUEST,
    TAG_BATCH,
    TAG_BYE,
    TAG_REQUEST,
    Fetch,
    Inbox,
    batch_header,
    parse_batch,
    parse_request,
    request_header,
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
# Peers' requests that a plain read answers never pass through the event loop: bytes the page
# cache holds (up to this size) are read by the MPI thread itself, the rest by this many server
# threads, which hand the reply straight back to the MPI thread.
INLINE_READ_LIMIT = 1 << 20
PR_SET_TIMERSLACK = 29  # linux/prctl.h
PR_SET_NAME = 15
TIMER_SLACK_NS = 1000
SERVER_THREADS = 4
# The front's READs that may wait for peers' pieces at once (module docstring).
NATIVE_WAITING = FRONT_THREADS - 1
# Bytes of replies that may wait for their requesters at once (a requester that gave up never
# takes its reply, which then stays in the sender's memory): beyond, new requests are refused.
REPLY_BYTES = 64 << 20


def _precise_timeouts() -> None:
    """Let this thread's short waits end on time: Linux adds a "timer slack" of 50 us to every
    timed wait so that wake-ups can be batched, which made a 50 us poll last 120 us here (73 us
    with 1 us of slack, most of the rest being the wake-up itself). And name it for the system
    (`fanfs bench --calibrate`, top, perf tell it from the daemon's other threads)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(b"fanfs-mpi"), 0, 0, 0)


# Commands from trio tasks to the MPI thread (one queue, read only by that thread).
@dataclass(frozen=True, slots=True)
class _Send:
    """Post the receive of a reply, then send the request header."""

    peer: int
    tag: int
    header: np.ndarray
    job: Fetch
    kind: int = TAG_REQUEST  # or TAG_BATCH


@dataclass(frozen=True, slots=True)
class _Cancel:
    """The fetch of `tag` timed out: cancel its receives."""

    tag: int


@dataclass(frozen=True, slots=True)
class _Reply:
    """Send a peer the stored bytes it asked for (None: an empty refusal) of `entry`."""

    peer: int
    tag: int
    data: bytes | bytearray | memoryview | None
    entry: int
    direct: bool = False  # read by the transport's threads, not through the event loop
    reserved: int = 0  # reply bytes `_request` reserved for it, released once sent
    files: int = 1  # files it answers (a batch's)


@dataclass(frozen=True, slots=True)
class _Bye:
    """Tell every live peer this daemon has unmounted."""


@dataclass(frozen=True, slots=True)
class _Stop:
    """Cancel the standing receives and end the MPI thread."""


_Command = _Send | _Cancel | _Reply | _Bye | _Stop


# A server thread's read: (peer, reply tag, entry, pieces (partition, start, length)), the
# reply being the pieces back to back.
_Read = tuple[int, int, int, tuple[tuple[int, int, int], ...]]


class MpiTransport(PeerTransport):
    blocking_fetch = True
    batches = True

    def __init__(
        self,
        world: World,
        peer_timeout: float,
        server: Served,
        native_remote: bool = False,
    ):
        """`native_remote`: take the front's requests for peers' files (module docstring)."""
        super().__init__(world.rank, world.size, peer_timeout, server)
        self.native_remote = native_remote
        # Written with every command (and by the front): the MPI thread waits on it.
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # reply tag -> (fetch, when to hedge it (inf: done), when to give up on its holder)
        self._natives: dict[int, tuple[Fetch, float, float]] = {}
        self._native_retry: list[tuple[tuple[Any, ...], tuple[int, ...]]] = []
        self._asked: dict[tuple[Any, ...], int] = {}  # front's request -> its fetches out
        self.MPI = world.MPI
        self.comm = world.comm
        self._reads: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._servers: list[threading.Thread] = []
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._tag_ub = int(self.comm.Get_attr(self.MPI.TAG_UB) or 32767)
        self._next_tag = FIRST_REPLY_TAG
        self._outstanding: dict[int, Fetch | None] = {}  # reply tags in use (None: quarantined)
        self._reply_bytes = 0  # bytes of replies not yet sent (the MPI thread's)
        self._lock = threading.Lock()  # reply tags and counters: the event loop and threads
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
            for i in range(SERVER_THREADS):
                t = threading.Thread(target=self._server, name=f"fanfs-serve-{i}", daemon=True)
                t.start()
                self._servers.append(t)
            task_status.started()
            await trio.sleep_forever()

    def _post(self, cmd: _Command) -> None:
        """Queue a command for the MPI thread and wake it (any thread)."""
        self._cmds.put(cmd)
        os.eventfd_write(self._wake, 1)

    def _tag(self) -> int:
        while True:
            tag = self._next_tag
            self._next_tag = tag + 1 if tag + 1 < self._tag_ub else FIRST_REPLY_TAG
            if tag not in self._outstanding:
                return tag

    def _start(self, peer: int, job: Fetch, header: Callable[[int], np.ndarray],
               kind: int = TAG_REQUEST) -> int:  # fmt: skip
        """Hand the MPI thread a fetch (any thread): `header(reply_tag)` sent with MPI tag
        `kind` (a request or a batch); its reply tag."""
        with self._lock:
            tag = self._tag()
            self._outstanding[tag] = job
        self._post(_Send(peer, tag, header(tag), job, kind))
        return tag

    def _forget(self, tag: int, done: bool) -> None:
        """A fetch is over: the MPI thread frees its tag once its reply is taken (or drained,
        when the fetch gave up first)."""
        if not done:
            self._post(_Cancel(tag))

    def _release(self, tag: int) -> None:
        with self._lock:
            self._outstanding.pop(tag, None)

    def _result(self, peer: int, job: Fetch, done: bool, began: float) -> bytes | None:
        if not self._arrived(peer, job, done):
            return None  # a refusal, or a reply of the wrong size: another source
        with self._lock:
            self._fetched(began, job.length, time.perf_counter())
        return bytes(job.buf) if job.length <= CHUNK else job.buf  # type: ignore[return-value]

    def _arrived(self, peer: int, job: Fetch, done: bool) -> bool:
        """Whether all `job` asked for came; PeerTimeout if the peer did not answer."""
        if not done:
            raise self._timed_out(peer)
        if job.count == -1:
            self._mark_dead(peer, "cannot be reached")
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
            self._native_done(job, count)
        elif job.waiter is not None:
            job.finish(count)
        else:
            self._call_trio(job.finish, count)

    def _on_request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._answer, peer, entry, offset, length, tag)

    async def _answer(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        data = await self._serve_request(peer, entry, offset, length)
        self._post(_Reply(peer, tag, data, entry, reserved=length))

    def _say_bye(self) -> None:
        self._post(_Bye())

    def stop(self) -> None:
        for _ in self._servers:
            self._reads.put(None)
        for t in self._servers:
            t.join(timeout=10)
        self._post(_Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- server threads --------------------------------------------------------------------

    def _server(self) -> None:
        """Read what peers asked for that is not in the page cache (may wait for the disk)."""
        while (job := self._reads.get()) is not None:
            peer, tag, entry, pieces = job
            data: bytes | None = None
            try:
                if len(pieces) == 1:
                    data = self.server.pread(*pieces[0])
                else:
                    data = b"".join(self.server.pread(*p) for p in pieces)
            except OSError as e:
                log.warning("cannot serve entry %d to rank %d: %s", entry, peer, e)
            except Exception:
                log.exception("serving entry %d to rank %d failed", entry, peer)
            reserved = sum(n for _, _, n in pieces)
            self._post(_Reply(peer, tag, data, entry, True, reserved, len(pieces)))

    # -- the MPI thread --------------------------------------------------------------------

    def _call_trio(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _loop(self) -> None:
        _precise_timeouts()
        try:
            if self.native_remote:
                lib.remote_set_wake(self._wake, NATIVE_WAITING, self.peer_timeout)
            self._serve()
        except Exception:
            # Not expected (MPI errors are handled where they happen); should it happen, peers
            # route around this daemon after their peer timeout and our fetches fall back.
            log.exception("the MPI thread failed: remote reads now go to the image")
        finally:
            if self.native_remote:  # every READ waiting for a peer goes to Python
                lib.remote_set_wake(-1)
                self._natives.clear()
                self._native_retry.clear()
                self._asked.clear()

    def _serve(self) -> None:
        MPI = self.MPI
        header = np.empty(4, dtype=np.int64)
        batch = np.empty(BATCH_HEADER, dtype=np.int64)
        bye = np.empty(1, dtype=np.int64)
        status = MPI.Status()
        inbox = Inbox(self.comm, MPI, self.peer_timeout, self._delivered, self._release,
                      self._count_malformed)  # fmt: skip
        sending: list[tuple[Any, Any, int]] = []  # (request, buffer kept alive, bytes reserved)
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
                if isinstance(cmd, _Stop):
                    inbox.close([(req, buf) for req, buf, _ in sending])
                    return
                self._command(cmd, inbox, sending)
            asked = self._take_asked
            busy |= asked(inbox, status, TAG_REQUEST, header, parse_request, self._request)
            busy |= asked(inbox, status, TAG_BATCH, batch, parse_batch, self._batch)
            while (size := inbox.probe(MPI.ANY_SOURCE, TAG_BYE, status, bye)) is not None:
                busy = True
                if size < 0:
                    break
                if size == bye.nbytes:
                    self._byes.add(status.Get_source())
                else:
                    self._count_malformed()
            busy |= inbox.take_all(status)
            if self.native_remote:
                busy |= self._natives_step(inbox, sending)
            kept = []
            for req, buf, reserved in sending:
                if self._done(req):
                    self._reply_bytes -= reserved
                else:
                    kept.append((req, buf, reserved))
            sending = kept
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

    def _take_asked(self, inbox: Inbox, status: Any, tag: int, buf: np.ndarray,
                    parse: Callable[[np.ndarray, int], tuple[Any, ...] | None],
                    answer: Callable[..., None]) -> bool:  # fmt: skip
        """Take every pending message with `tag` (requests, batches) into `buf`, each checked
        by `parse` and answered by `answer(peer, *parsed)`; True if any came."""
        busy = False
        while (size := inbox.probe(self.MPI.ANY_SOURCE, tag, status, buf)) is not None:
            busy = True
            if size < 0:
                break  # (could not be taken, and counted: the next turn tries again)
            peer = status.Get_source()
            asked = parse(buf, self._tag_ub) if size == buf.nbytes else None
            if asked is not None:
                answer(peer, *asked)
            else:
                self._count_malformed()
                log.warning("malformed message (tag %d, %d bytes) from rank %d ignored", tag,
                            size, peer)  # fmt: skip
        return busy

    def _count_malformed(self) -> None:
        self.malformed += 1

    # -- the front's fetches (native_remote) -----------------------------------------------

    def _natives_step(self, inbox: Inbox, sending: list[tuple[Any, Any, int]]) -> bool:
        """Start the front's new requests and the retries, give up on silent holders."""
        todo: list[tuple[tuple[Any, ...], tuple[int, ...]]] = [
            (req, ()) for req in lib.remote_take()
        ]
        todo += self._native_retry
        self._native_retry = []
        if self._natives:
            now = time.monotonic()
            for tag, (job, hedge, deadline) in list(self._natives.items()):
                if now > deadline:  # silent: dead from now on, the next holder is asked
                    del self._natives[tag]
                    self._unask(job.native[0])
                    inbox.forget(tag)
                    self._timed_out(job.peer)
                    todo.append(job.native[:2])
                elif now > hedge:  # slow: another holder is asked too, if there is one
                    self._natives[tag] = (job, math.inf, deadline)
                    req, tried = job.native[:2]
                    if self._holders(req, tried):
                        with self._lock:
                            self.hedged += 1
                        todo.append((req, tried))
        for req, tried in todo:
            try:
                self._native_start(req, tried, inbox, sending)
            except Exception:  # not expected: this READ goes to Python, the others go on
                log.exception("fetching entry %d for the front failed", req[2])
                lib.remote_fail(req)
        return bool(todo)

    def _native_start(self, req: tuple[Any, ...], tried: tuple[int, ...], inbox: Inbox,
                      sending: list[tuple[Any, Any, int]]) -> None:  # fmt: skip
        """Ask the next live holder of a front's request for its stored bytes, or give it up."""
        peers = self._holders(req, tried)
        if not peers:
            if req not in self._asked:
                lib.remote_fail(req)  # (else a hedged fetch still out may yet fill it)
            return
        if not lib.remote_pending(req):
            return  # filled meanwhile (a hedge, a retry after a refusal)
        entry, length = req[2], req[5]
        peer = peers[0]
        job = Fetch(peer, length, bytearray(length))
        with self._lock:
            tag = self._tag()
            self._outstanding[tag] = job
        job.native = (req, (*tried, peer), time.perf_counter(), tag)
        now = time.monotonic()
        self._natives[tag] = (job, now + self.hedge_delay(), now + self.peer_timeout)
        self._asked[req] = self._asked.get(req, 0) + 1
        try:
            header = request_header(entry, 0, length, tag)  # its stored bytes
            self._command(_Send(peer, tag, header, job), inbox, sending)
        except BaseException:  # (an MPI error is delivered as a dead peer, not raised)
            if self._natives.pop(tag, None) is not None:
                self._unask(req)
                inbox.drop(tag)
            raise

    def _unask(self, req: tuple[Any, ...]) -> None:
        left = self._asked.pop(req) - 1
        if left:
            self._asked[req] = left

    def _holders(self, req: tuple[Any, ...], tried: tuple[int, ...]) -> list[int]:
        """The live holders of a request's piece not asked yet, rotated per file as
        Sources.peers does, to spread load over replicas."""
        entry, holders = req[2], req[7]
        k = entry % max(1, len(holders))
        return [p for p in holders[k:] + holders[:k]
                if p != self.rank and p not in self._dead and p not in tried]  # fmt: skip

    def _native_done(self, job: Fetch, count: int) -> None:
        """A front's fetch is over: the bytes to the C, or the next holder."""
        req, tried, began, tag = job.native
        if self._natives.pop(tag, None) is None:
            return  # given up on already (its holder timed out)
        self._unask(req)
        if count == job.length:
            err = lib.remote_fill(req, job.buf)
            if err == 0:
                with self._lock:
                    self._fetched(began, job.length, time.perf_counter())
                    self.hedges_won += len(tried) > 1 and req in self._asked  # one is still out
                return
            if err == errno.ESTALE:
                return  # given up meanwhile
            log.warning("bad copy of entry %d from rank %d (%s), asking another holder",
                        req[2], job.peer, os.strerror(err))  # fmt: skip
        elif count == -1:
            self._mark_dead(job.peer, "cannot be reached")
        self._native_retry.append((req, tried))

    def _request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        """Answer a peer's request: a ping at once; a plain read from the page cache here,
        from the disk by a server thread; anything else (a large raw file not checked yet, a
        request to refuse) by the server's `serve` in the event loop. Replies go out through
        the command queue, which the loop reads again before it waits."""
        if entry == -1 and length == 0:
            self._post(_Reply(peer, tag, None, entry))
            return
        if length > MAX_REQUEST or self._reply_bytes + length > REPLY_BYTES:
            # Too much at once: refused (the requester tries another source); the bytes are
            # reserved until the reply has been sent, which a requester that gave up never takes.
            self._post(_Reply(peer, tag, None, entry))
            return
        self._reply_bytes += length
        located = None
        try:
            located = self.server.locate(entry, offset, length)
            if located is not None and length <= INLINE_READ_LIMIT:
                data = self.server.cached(*located, length)
                if data is not None:
                    self._post(_Reply(peer, tag, data, entry, direct=True, reserved=length))
                    return
        except Exception as e:  # a disk error: the server thread tries again and reports it
            log.debug("inline read for rank %d failed: %s", peer, e)
        if located is not None:
            self._reads.put((peer, tag, entry, ((*located, length),)))
        else:
            self._call_trio(self._on_request, peer, entry, offset, length, tag)

    def _batch(self, peer: int, tag: int, entries: list[int]) -> None:
        """Answer a peer's batch: every file's whole stored bytes, back to back, read by a
        server thread; refused whole (an empty reply) if one is not a plain read here or the
        reply would be too large, and the requester asks file by file."""
        pieces = []
        for entry in entries:
            try:
                piece = self.server.whole(entry)
            except Exception as e:  # not expected: the requester asks file by file
                log.warning("batch entry %d from rank %d: %s", entry, peer, e)
                piece = None
            if piece is None:
                self._post(_Reply(peer, tag, None, entry))
                return
            pieces.append(piece)
        total = sum(n for _, _, n in pieces)
        if total > MAX_REQUEST or self._reply_bytes + total > REPLY_BYTES:
            self._post(_Reply(peer, tag, None, entries[0]))
            return
        self._reply_bytes += total
        self._reads.put((peer, tag, entries[0], tuple(pieces)))

    def _done(self, req: Any) -> bool:
        try:
            return bool(req.Test())
        except self.MPI.Exception as e:
            log.warning("MPI send failed: %s", e)
            return True

    def _command(self, cmd: _Command, inbox: Inbox, sending: list[tuple[Any, Any, int]]) -> None:
        comm = self.comm
        try:
            if isinstance(cmd, _Send):
                inbox.expect(cmd.tag, cmd.job)
                sending.append((comm.Isend(cmd.header, cmd.peer, cmd.kind), cmd.header, 0))
            elif isinstance(cmd, _Cancel):
                inbox.forget(cmd.tag)
            elif isinstance(cmd, _Reply):
                self._count_reply(cmd.entry, cmd.data, cmd.direct, cmd.files)
                # What `_request` reserved for it is released once its last part is sent.
                if cmd.data is None:
                    sending.append((comm.Isend([b"", self.MPI.BYTE], cmd.peer, cmd.tag), None,
                                    cmd.reserved))  # fmt: skip
                else:
                    view = memoryview(cmd.data)
                    for off in range(0, len(view), CHUNK):
                        last = off + CHUNK >= len(view)
                        sending.append((comm.Isend(view[off : off + CHUNK], cmd.peer, cmd.tag),
                                        cmd.data, cmd.reserved if last else 0))  # fmt: skip
            elif isinstance(cmd, _Bye):
                me = np.array([self.rank], dtype=np.int64)
                for peer in range(self.size):
                    if peer != self.rank and peer not in self._dead:
                        sending.append((comm.Isend(me, peer, TAG_BYE), me, 0))
        except self.MPI.Exception as e:
            peer = cmd.peer if isinstance(cmd, (_Send, _Reply)) else -1
            log.warning("MPI %s to rank %d failed: %s", type(cmd).__name__[1:], peer, e)
            if isinstance(cmd, _Send):
                inbox.drop(cmd.tag)
                self._delivered(cmd.job, -1)
            elif isinstance(cmd, _Reply):
                self._reply_bytes -= cmd.reserved
