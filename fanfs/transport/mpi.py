"""The MPI transport: remote reads in one round trip, over the `World` of transport/world.py.

Protocol (point-to-point on a duplicate of COMM_WORLD, buffer API, no pickle on the data path):
- request, tag 1: four int64 `(entry, offset, length, reply_tag)`, 32 bytes; `length` at most
  MAX_REQUEST (what the largest legitimate read asks), else refused;
- reply, tag `reply_tag`: the stored bytes (still compressed) in chunks under 2 GiB, or one
  empty message when the owner cannot serve them (refused, or too busy: more than
  REPLY_BYTES in replies not yet taken by their requesters). The requester knows `length`
  from its own catalog;
- bye, tag 2: "I have unmounted". A daemon stops serving only when every peer said bye or is
  found dead, so no peer loses its source while it still reads.
Reply tags cycle through [16, TAG_UB) and are never reused while a fetch is outstanding.

Concurrency: one thread (`fanfs-mpi`) makes every MPI call after start-up. Trio tasks hand it
commands through a thread-safe queue; it answers with `TrioToken.run_sync_soon`, which never
blocks the MPI thread (the planner's threads, which fetch with `fetch_blocking`, are woken
directly). While a fetch that a reader waits for is outstanding it polls without sleeping
(yielding the CPU between polls) for up to SPIN_S after the last event: a sleep of even 50 us
added a tenth of a millisecond to every remote file (see docs/performance.md). Otherwise it
blocks on the queue with a timeout: 20 us for HOT_S after any traffic, backing off to 2 ms once
idle (a blocking Recv would burn a core, and on 2-core nodes that matters; idle, a daemon uses
about 1 % of one). A peer's request that a plain read answers (`DirectReads`) is served
without the event loop: the MPI thread reads what the page cache holds, SERVER_THREADS threads
read the rest from the disk, and both put the reply on the command queue. Other requests
(refusals, large raw files not checked yet) go to `serve_fn` in the event loop.
After start-up no collective operation is used, so a dead rank can only cost its own
requests a peer timeout, after which it is routed around.

Every message is taken by a matched probe (MPI_Improbe), its size checked, and only then
received into a buffer of exactly that size: a receive posted in advance would let a peer's
longer message run past its buffer (Open MPI's shared-memory transport writes the whole
message before it reports the truncation; tested). A message of the wrong size is counted as
malformed and, if small, received and dropped (if large, left where it is: never allocated
for). A fetch that timed out keeps its reply tag quarantined until its reply is drained, so a
late reply can never be taken for a later fetch's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from fanfs.transport import DirectReads, PeerTimeout, PeerTransport, ServeFn
from fanfs.transport.world import CHUNK, World

log = logging.getLogger(__name__)

TAG_REQUEST = 1
TAG_BYE = 2
FIRST_REPLY_TAG = 16
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
TIMER_SLACK_NS = 1000
SERVER_THREADS = 4
# The most stored bytes a peer may ask for at once: a raw file read whole (the reader's
# WHOLE_FILE_LIMIT), a frame, a frame table of a file up to 2 TiB. Larger: refused.
MAX_REQUEST = 16 << 20
# Bytes of replies that may wait for their requesters at once (a requester that gave up never
# takes its reply, which then stays in the sender's memory): beyond, new requests are refused.
REPLY_BYTES = 64 << 20
# A message that is not what was asked (a late reply, a bad one) is received and dropped up to
# this size; a larger one is left unreceived rather than allocated for.
DISCARD_MAX = MAX_REQUEST
# A quarantined reply tag is released after this many peer timeouts even if its reply never
# came (a dead peer): tags cycle through millions, so this only bounds the bookkeeping.
QUARANTINE_TIMEOUTS = 10


def _precise_timeouts() -> None:
    """Let this thread's short waits end on time: Linux adds a "timer slack" of 50 us to every
    timed wait so that wake-ups can be batched, which made a 50 us poll last 120 us here (73 us
    with 1 us of slack, most of the rest being the wake-up itself)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)


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


@dataclass
class _Incoming:
    """A reply being taken: the bytes matched so far and their receives."""

    peer: int
    job: _Fetch | None  # None: quarantined (the fetch gave up; drain, then free the tag)
    expect: int  # the bytes asked for
    got: int = 0
    replied: bool = False  # an empty reply came (a refusal, a ping's answer)
    reqs: list[Any] = field(default_factory=list)
    until: float = 0.0  # quarantine: release the tag after this (monotonic)


@dataclass
class _Fetch:
    peer: int
    length: int
    buf: bytearray
    event: trio.Event = field(default_factory=trio.Event)
    count: int = -1  # bytes received; -1: failed
    waiter: threading.Event | None = None  # a thread's fetch (fetch_blocking), not a task's


# Commands from trio tasks to the MPI thread (one queue, read only by that thread).
@dataclass(frozen=True, slots=True)
class _Send:
    """Post the receive of a reply, then send the request header."""

    peer: int
    tag: int
    header: np.ndarray
    job: _Fetch


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


@dataclass(frozen=True, slots=True)
class _Bye:
    """Tell every live peer this daemon has unmounted."""


@dataclass(frozen=True, slots=True)
class _Stop:
    """Cancel the standing receives and end the MPI thread."""


_Command = _Send | _Cancel | _Reply | _Bye | _Stop


class MpiTransport(PeerTransport):
    blocking_fetch = True

    def __init__(
        self,
        world: World,
        peer_timeout: float,
        serve_fn: ServeFn | None = None,
        direct: DirectReads | None = None,
    ):
        super().__init__(world.rank, world.size, peer_timeout)
        self.MPI = world.MPI
        self.comm = world.comm
        self.serve_fn = serve_fn
        self.direct = direct
        self._reads: queue.SimpleQueue[tuple[int, int, int, int, int, int] | None]
        self._reads = queue.SimpleQueue()  # (peer, tag, entry, part, start, length) to read
        self._servers: list[threading.Thread] = []
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._tag_ub = int(self.comm.Get_attr(self.MPI.TAG_UB) or 32767)
        self._next_tag = FIRST_REPLY_TAG
        self._outstanding: dict[int, _Fetch | None] = {}  # reply tags in use (None: quarantined)
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
            if self.direct is not None:
                for i in range(SERVER_THREADS):
                    t = threading.Thread(target=self._server, name=f"fanfs-serve-{i}", daemon=True)
                    t.start()
                    self._servers.append(t)
            task_status.started()
            await trio.sleep_forever()

    def _tag(self) -> int:
        while True:
            tag = self._next_tag
            self._next_tag = tag + 1 if tag + 1 < self._tag_ub else FIRST_REPLY_TAG
            if tag not in self._outstanding:
                return tag

    def _start(self, peer: int, entry: int, offset: int, length: int, job: _Fetch) -> int:
        """Hand the MPI thread a fetch (any thread); its reply tag."""
        with self._lock:
            tag = self._tag()
            self._outstanding[tag] = job
        header = np.array([entry, offset, length, tag], dtype=np.int64)
        self._cmds.put(_Send(peer, tag, header, job))
        return tag

    def _forget(self, tag: int, done: bool) -> None:
        """A fetch is over: the MPI thread frees its tag once its reply is taken (or drained,
        when the fetch gave up first)."""
        if not done:
            self._cmds.put(_Cancel(tag))

    def _release(self, tag: int) -> None:
        with self._lock:
            self._outstanding.pop(tag, None)

    def _result(self, peer: int, job: _Fetch, done: bool, began: float) -> bytes | None:
        if not done:
            raise self._timed_out(peer)
        if job.count == -1:
            self._mark_dead(peer, "cannot be reached")
            raise PeerTimeout(f"rank {peer} cannot be reached")
        if job.count != job.length:
            return None  # a refusal, or a reply of the wrong size: another source
        with self._lock:
            self._fetched(began, job.length, time.perf_counter())
        return bytes(job.buf) if job.length <= CHUNK else job.buf  # type: ignore[return-value]

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        if peer in self._dead:
            raise PeerTimeout(f"rank {peer} is dead")
        job = _Fetch(peer, length, bytearray(length))
        began = time.perf_counter()
        tag = self._start(peer, entry, offset, length, job)
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
        if peer in self._dead:
            raise PeerTimeout(f"rank {peer} is dead")
        waiter = threading.Event()
        job = _Fetch(peer, length, bytearray(length), waiter=waiter)
        began = time.perf_counter()
        tag = self._start(peer, entry, offset, length, job)
        done = waiter.wait(self.peer_timeout)
        self._forget(tag, done)
        return self._result(peer, job, done, began)

    def _delivered(self, job: _Fetch, count: int) -> None:
        """(The MPI thread.) Wake whoever waits for `job`: a thread at once, a task through
        the event loop."""
        if job.waiter is not None:
            job.count = count
            job.waiter.set()
        else:
            self._call_trio(self._deliver, job, count)

    def _deliver(self, job: _Fetch, count: int) -> None:
        job.count = count
        job.event.set()

    def _on_request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._answer, peer, entry, offset, length, tag)

    async def _answer(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        data = await self._serve_request(peer, entry, offset, length)
        self._cmds.put(_Reply(peer, tag, data, entry, reserved=length))

    def _say_bye(self) -> None:
        self._cmds.put(_Bye())

    def stop(self) -> None:
        for _ in self._servers:
            self._reads.put(None)
        for t in self._servers:
            t.join(timeout=10)
        self._cmds.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- server threads --------------------------------------------------------------------

    def _server(self) -> None:
        """Read what peers asked for that is not in the page cache (may wait for the disk)."""
        assert self.direct is not None
        while (job := self._reads.get()) is not None:
            peer, tag, entry, part, start, length = job
            data: bytes | None = None
            try:
                data = self.direct.pread(part, start, length)
            except OSError as e:
                log.warning("cannot serve entry %d to rank %d: %s", entry, peer, e)
            except Exception:
                log.exception("serving entry %d to rank %d failed", entry, peer)
            self._cmds.put(_Reply(peer, tag, data, entry, direct=True, reserved=length))

    # -- the MPI thread --------------------------------------------------------------------

    def _call_trio(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _loop(self) -> None:
        _precise_timeouts()
        try:
            self._serve()
        except Exception:
            # Not expected (MPI errors are handled where they happen); should it happen, peers
            # route around this daemon after their peer timeout and our fetches fall back.
            log.exception("the MPI thread failed: remote reads now go to the image")

    def _serve(self) -> None:
        MPI = self.MPI
        header = np.empty(4, dtype=np.int64)
        bye = np.empty(1, dtype=np.int64)
        status = MPI.Status()
        receiving: dict[int, _Incoming] = {}  # reply tag -> the reply being taken
        sending: list[tuple[Any, Any, int]] = []  # (request, buffer kept alive, bytes reserved)
        idle = POLL_MIN_S
        hot_until = moved = 0.0
        while True:
            busy = False
            try:
                cmd = self._cmds.get(timeout=idle) if idle else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
                if not idle:
                    os.sched_yield()  # spinning: let the readers and the event loop run first
            while cmd is not None:
                busy = True
                if isinstance(cmd, _Stop):
                    return
                self._command(cmd, receiving, sending)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            while (size := self._probe(MPI.ANY_SOURCE, TAG_REQUEST, status, header)) is not None:
                busy = True
                peer = status.Get_source()
                request = parse_request(header, self._tag_ub) if size == header.nbytes else None
                if request is not None:
                    self._request(peer, *request)
                else:
                    self.malformed += 1
                    log.warning("malformed request (%d bytes) from rank %d ignored", size, peer)
            while (size := self._probe(MPI.ANY_SOURCE, TAG_BYE, status, bye)) is not None:
                busy = True
                if size == bye.nbytes:
                    self._byes.add(status.Get_source())
                else:
                    self.malformed += 1
            for tag, rec in list(receiving.items()):
                busy |= self._take(tag, rec, receiving, status)
            kept = []
            for req, buf, reserved in sending:
                if self._done(req):
                    self._reply_bytes -= reserved
                else:
                    kept.append((req, buf, reserved))
            sending = kept
            now = time.monotonic()
            if busy or receiving:
                hot_until = now + HOT_S
            if busy:
                moved = now
            # A reader waits for one of our fetches (not only the planner's threads, which
            # want throughput and can wait a poll): no sleep at all.
            if now - moved < SPIN_S and any(r.job is not None and r.job.waiter is None
                                            for r in receiving.values()):  # fmt: skip
                idle = 0.0
            else:
                idle = POLL_MIN_S if now < hot_until else min(max(idle, POLL_MIN_S) * 2, POLL_MAX_S)

    def _probe(self, source: int, tag: int, status: Any, buf: np.ndarray) -> int | None:
        """The size of the next message from `source` with `tag`, taken into `buf` if it is
        exactly `buf`'s size (else dropped, or left unreceived if large); None if none."""
        try:
            msg = self.comm.Improbe(source, tag, status)
            if msg is None:
                return None
            size = int(status.Get_count(self.MPI.BYTE))
            if size == buf.nbytes:
                msg.Recv(buf)
            else:
                self._discard(msg, size)
            return size
        except self.MPI.Exception as e:
            self.malformed += 1
            log.warning("a message with tag %d could not be taken: %s", tag, e)
            return -1

    def _discard(self, msg: Any, size: int) -> None:
        """Take a message that is not what was asked for and drop it, if it is small enough to
        take; a larger one stays where it is (its sender holds it)."""
        if 0 <= size <= DISCARD_MAX:
            msg.Recv([bytearray(max(size, 1)), size, self.MPI.BYTE])

    def _take(self, tag: int, rec: _Incoming, receiving: dict[int, _Incoming],
              status: Any) -> bool:  # fmt: skip
        """Take what arrived of one reply; deliver it once complete. True if anything moved."""
        MPI, job = self.MPI, rec.job
        moved = False
        try:
            while job is None or rec.got < job.length or (job.length == 0 and not rec.replied):
                msg = self.comm.Improbe(rec.peer, tag, status)
                if msg is None:
                    break
                moved = True
                size = int(status.Get_count(MPI.BYTE))
                if job is None:  # quarantined: a late reply, dropped
                    self._discard(msg, size)
                    rec.got += size
                    rec.replied |= size == 0
                    continue
                want = min(CHUNK, job.length - rec.got)
                if size == 0 and rec.got == 0:  # a refusal (or a ping's answer)
                    msg.Recv([bytearray(1), 0, MPI.BYTE])
                    rec.replied = True
                    del receiving[tag]
                    self._release(tag)
                    self._delivered(job, 0)
                    return True
                if size != want:  # not what was asked: not this peer's bytes
                    self._discard(msg, size)
                    self.malformed += 1
                    log.warning("a reply of %d bytes from rank %d, %d asked", size, rec.peer,
                                want)  # fmt: skip
                    self._quarantine(tag, rec)
                    self._delivered(job, -2)
                    return True
                view = memoryview(job.buf)[rec.got : rec.got + size]
                rec.reqs.append(msg.Irecv(view))
                rec.got += size
            done = bool(MPI.Request.Testall(rec.reqs)) if rec.reqs else True
        except MPI.Exception as e:
            log.warning("bad reply from rank %d: %s", rec.peer, e)
            if job is not None:
                self._quarantine(tag, rec)
                self._delivered(job, -1)
            return True
        if job is None:  # drained, or its peer is quiet too long: the tag is free again
            if (done and (rec.replied or rec.got >= rec.expect)) or time.monotonic() > rec.until:
                del receiving[tag]
                self._release(tag)
            return moved
        if done and rec.got == job.length and job.length > 0:
            del receiving[tag]
            self._release(tag)
            self._delivered(job, job.length)
            return True
        return moved

    def _quarantine(self, tag: int, rec: _Incoming) -> None:
        """The fetch of `tag` is over but its peer may still send: drain what comes, then
        free the tag (or after QUARANTINE_TIMEOUTS peer timeouts)."""
        rec.job = None
        rec.until = time.monotonic() + QUARANTINE_TIMEOUTS * self.peer_timeout

    def _request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        """Answer a peer's request: a ping at once; a plain read from the page cache here,
        from the disk by a server thread; anything else (a large raw file not checked yet, a
        request to refuse) by `serve_fn` in the event loop. Replies go out through the command
        queue, which the loop reads again before it waits."""
        if entry == -1 and length == 0:
            self._cmds.put(_Reply(peer, tag, None, entry))
            return
        if length > MAX_REQUEST or self._reply_bytes + length > REPLY_BYTES:
            # Too much at once: refused (the requester tries another source); the bytes are
            # reserved until the reply has been sent, which a requester that gave up never takes.
            self._cmds.put(_Reply(peer, tag, None, entry))
            return
        self._reply_bytes += length
        located = None
        try:
            if self.direct is not None:
                located = self.direct.locate(entry, offset, length)
            if located is not None and length <= INLINE_READ_LIMIT:
                assert self.direct is not None
                data = self.direct.pread_cached(*located, length)
                if data is not None:
                    self._cmds.put(_Reply(peer, tag, data, entry, direct=True, reserved=length))
                    return
        except Exception as e:  # a disk error: the server thread tries again and reports it
            log.debug("inline read for rank %d failed: %s", peer, e)
        if located is not None:
            self._reads.put((peer, tag, entry, *located, length))
        else:
            self._call_trio(self._on_request, peer, entry, offset, length, tag)

    def _done(self, req: Any) -> bool:
        try:
            return bool(req.Test())
        except self.MPI.Exception as e:
            log.warning("MPI send failed: %s", e)
            return True

    def _command(
        self,
        cmd: _Command,
        receiving: dict[int, _Incoming],
        sending: list[tuple[Any, Any, int]],
    ) -> None:
        comm = self.comm
        try:
            if isinstance(cmd, _Send):
                receiving[cmd.tag] = _Incoming(cmd.peer, cmd.job, cmd.job.length)
                sending.append((comm.Isend(cmd.header, cmd.peer, TAG_REQUEST), cmd.header, 0))
            elif isinstance(cmd, _Cancel):
                rec = receiving.get(cmd.tag)
                if rec is None:
                    self._release(cmd.tag)
                else:
                    self._quarantine(cmd.tag, rec)
            elif isinstance(cmd, _Reply):
                self._count_reply(cmd.entry, cmd.data, cmd.direct)
                # What `_request` reserved for it (a refusal of a request it took: all of it).
                reserved = int(cmd.reserved)
                if cmd.data is None:
                    sending.append((comm.Isend([b"", self.MPI.BYTE], cmd.peer, cmd.tag), None,
                                    reserved))  # fmt: skip
                else:
                    view = memoryview(cmd.data)
                    for off in range(0, len(view), CHUNK):
                        part = view[off : off + CHUNK]
                        last = off + CHUNK >= len(view)
                        sending.append((comm.Isend(part, cmd.peer, cmd.tag), cmd.data,
                                        reserved if last else 0))  # fmt: skip
            elif isinstance(cmd, _Bye):
                me = np.array([self.rank], dtype=np.int64)
                for peer in range(self.size):
                    if peer != self.rank and peer not in self._dead:
                        sending.append((comm.Isend(me, peer, TAG_BYE), me, 0))
        except self.MPI.Exception as e:
            peer = cmd.peer if isinstance(cmd, (_Send, _Reply)) else -1
            log.warning("MPI %s to rank %d failed: %s", type(cmd).__name__[1:], peer, e)
            if isinstance(cmd, _Send):
                receiving.pop(cmd.tag, None)
                self._release(cmd.tag)
                self._delivered(cmd.job, -1)
            elif isinstance(cmd, _Reply):
                self._reply_bytes -= int(cmd.reserved)
