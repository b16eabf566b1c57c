"""The MPI transport's messages, and how its thread takes them: never into a buffer sized in
advance.

Protocol (point-to-point on a duplicate of COMM_WORLD, buffer API, no pickle on the data path):
- request, tag 1: four int64 `(entry, offset, length, reply_tag)`, 32 bytes;
- reply, tag `reply_tag`: the stored bytes (still compressed) in chunks under 2 GiB, or one
  empty message when the owner cannot serve them. The requester knows `length` from its own
  catalog;
- batch, tag 3: int64 `(reply_tag, n, entry_1, ..., entry_n)` padded with -1 to BATCH_MAX
  entries, 272 bytes: a planner asks for the whole stored bytes of up to BATCH_MAX files the
  peer holds. The reply (tag `reply_tag`) is their stored bytes back to back, in that order,
  or one empty message if the owner cannot serve them all (the requester then asks file by
  file). The requester knows each length from its own catalog;
- bye, tag 2: "I have unmounted". A daemon stops serving only when every peer said bye or is
  found dead, so no peer loses its source while it still reads.
Reply tags cycle through [16, TAG_UB) and are never reused while a fetch is outstanding.

Open MPI's shared-memory transport writes a message longer than a posted receive past that
receive's buffer before it reports the truncation (measured: 4 KiB past a 1 MiB buffer), so a
receive posted before the message is seen lets any peer write into the daemon's heap. Here
every message is found by a matched probe (MPI_Improbe), its size checked, and only then
received into exactly its size: requests and byes into their fixed headers, replies into the
fetch's buffer at the right place. A message of the wrong size is counted as malformed and
dropped (received into a scratch buffer, not waited for, if it is at most DISCARD_MAX, else
left unreceived: never allocated for). A fetch that gave up (a timeout) keeps its reply tag
quarantined until its late reply is drained (or QUARANTINE_TIMEOUTS peer timeouts pass), so a
late reply can never be taken for a later fetch's.

A receive that is still active when its fetch is given up for good (QUARANTINE_TIMEOUTS
passed) or the transport stops stays referenced, with its buffer, until MPI says it is
complete (tested each turn; at the stop for at most SETTLE_S, then kept for the life of the
process): an mpi4py request let go while active frees a buffer MPI may still write into. It is
not cancelled: its message is matched already, and a cancelled matched receive may put the
message back to be matched again, by a later fetch that reuses the tag.

Concurrency: the MPI thread only, except `Fetch`, which a trio task or a thread waits on,
and `ReplyTags`, which any thread asks (a lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from fanfs.world import CHUNK, leave_to_mpi

log = logging.getLogger(__name__)

TAG_REQUEST = 1
TAG_BYE = 2
TAG_BATCH = 3
FIRST_REPLY_TAG = 16

# The most stored bytes a peer may ask for at once: a raw file read whole (the reader's
# WHOLE_FILE_LIMIT), a frame, a frame table of a file up to 2 TiB. Larger: refused.
MAX_REQUEST = 16 << 20
# A message that is not what was asked (a late reply, a bad one) is received and dropped up to
# this size; a larger one is left unreceived rather than allocated for.
DISCARD_MAX = MAX_REQUEST
# A quarantined reply tag is released after this many peer timeouts even if its reply never
# came (a dead peer): tags cycle through millions, so this only bounds the bookkeeping.
QUARANTINE_TIMEOUTS = 10
# How long the stop waits for active receives to complete (a dead peer's may never): then
# they are left to MPI (world.leave_to_mpi), never freed, rather than freed under MPI.
SETTLE_S = 1.0
# Files one batch request names at most; its header is always BATCH_HEADER int64s.
BATCH_MAX = 32
BATCH_HEADER = 2 + BATCH_MAX


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


def request_header(entry: int, offset: int, length: int, tag: int) -> np.ndarray:
    """A request's header: `length` stored bytes of `entry` from `offset`, replied on `tag`."""
    return np.array([entry, offset, length, tag], dtype=np.int64)


def batch_header(tag: int, entries: list[int]) -> np.ndarray:
    """A batch request's header: reply tag, count, entries, -1 padding."""
    assert 1 <= len(entries) <= BATCH_MAX
    header = np.full(BATCH_HEADER, -1, dtype=np.int64)
    header[:2] = tag, len(entries)
    header[2 : 2 + len(entries)] = entries
    return header


def parse_batch(header: Any, tag_ub: int) -> tuple[int, list[int]] | None:
    """(reply tag, entries) of a peer's batch header, or None if it is not a well-formed one.
    The entries are checked later against the catalog by the serving side."""
    try:
        values = [int(x) for x in header]
    except (TypeError, ValueError):
        return None
    if len(values) != BATCH_HEADER:
        return None
    tag, n = values[:2]
    if not FIRST_REPLY_TAG <= tag < tag_ub or not 1 <= n <= BATCH_MAX:
        return None
    entries = values[2 : 2 + n]
    if min(entries) < 0:
        return None
    return tag, entries


@dataclass
class Fetch:
    """One fetch from a peer, waited for by a trio task (`event`) or a thread (`waiter`)."""

    peer: int
    length: int
    buf: bytearray
    event: trio.Event = field(default_factory=trio.Event)
    count: int = -1  # bytes received; -1: the peer cannot be reached; -2: a bad reply
    waiter: threading.Event | None = None  # a thread's fetch (fetch_blocking), not a task's
    native: Any = None  # the front's fetch (front.py's FrontFetch), done in the MPI thread

    def finish(self, count: int) -> None:
        """The outcome is known: wake whoever waits (a task's fetch: call it in trio's thread)."""
        self.count = count
        if self.waiter is not None:
            self.waiter.set()
        else:
            self.event.set()


class ReplyTags:
    """The reply tags in use: cycled through [FIRST_REPLY_TAG, tag_ub), never one in use
    (outstanding, or quarantined until its late reply is drained). Any thread (a lock)."""

    def __init__(self, tag_ub: int):
        self._ub = tag_ub
        self._next = FIRST_REPLY_TAG
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def reserve(self) -> int:
        """A free tag for a reply, in use until `release`."""
        with self._lock:
            while True:
                tag = self._next
                self._next = tag + 1 if tag + 1 < self._ub else FIRST_REPLY_TAG
                if tag not in self._used:
                    self._used.add(tag)
                    return tag

    def release(self, tag: int) -> None:
        """(The inbox.) The reply of `tag` was taken or drained: the tag is free again."""
        with self._lock:
            self._used.discard(tag)


@dataclass
class _Incoming:
    """A reply being taken: the bytes matched so far and their receives."""

    peer: int
    job: Fetch | None  # None: quarantined (the fetch gave up; drain, then free the tag)
    expect: int  # the bytes asked for
    got: int = 0
    replied: bool = False  # an empty reply came (a refusal, a ping's answer)
    reqs: list[Any] = field(default_factory=list)
    bufs: list[Any] = field(default_factory=list)  # what each receive writes into, held
    until: float = 0.0  # quarantine: release the tag after this (monotonic)

    def matched(self, size: int, req: Any | None = None, buf: Any = None) -> None:
        """`size` more bytes of the reply were matched (`req`: their receive into `buf`, if
        taken)."""
        self.got += size
        self.replied |= size == 0
        if req is not None:
            self.reqs.append(req)
            self.bufs.append(buf)

    def unfinished(self, done: Callable[[Any], bool]) -> list[tuple[Any, Any]]:
        """Hand over the receives `done` says MPI has not completed, with their buffers, and
        forget them all here."""
        left = [(r, b) for r, b in zip(self.reqs, self.bufs, strict=True) if not done(r)]
        self.reqs, self.bufs = [], []
        return left

    def quarantine(self, until: float) -> None:
        """The fetch gave up: drain what comes until `until`."""
        self.job = None
        self.until = until


class Inbox:
    def __init__(
        self,
        comm: Any,
        MPI: Any,
        peer_timeout: float,
        deliver: Callable[[Fetch, int], None],
        release: Callable[[int], None],
        malformed: Callable[[], None],
    ):
        """`deliver(fetch, count)` wakes whoever waits for a fetch; `release(tag)` frees a
        reply tag for reuse; `malformed()` counts a message that was not what was asked."""
        self.comm, self.MPI = comm, MPI
        self.peer_timeout = peer_timeout
        self._deliver, self._release, self._malformed = deliver, release, malformed
        self.receiving: dict[int, _Incoming] = {}  # reply tag -> the reply being taken
        # Receives of matched messages that a fetch gave up and MPI has not completed yet,
        # with their buffers: kept until it has (MPI writes into them until then). They are
        # never cancelled: a cancelled matched receive may hand its message back to be matched
        # again, where a later fetch with the same tag would take it for its reply.
        self._unfinished: list[tuple[Any, Any]] = []

    def expect(self, tag: int, job: Fetch) -> None:
        """A request with reply tag `tag` has been sent: take its reply as it comes."""
        self.receiving[tag] = _Incoming(job.peer, job, job.length)

    def forget(self, tag: int) -> None:
        """The fetch of `tag` gave up, or its request could not be sent."""
        rec = self.receiving.get(tag)
        if rec is None:
            self._release(tag)
        else:
            self._quarantine(rec)

    def drop(self, tag: int) -> None:
        """The request of `tag` was never sent: nothing will come."""
        self.receiving.pop(tag, None)
        self._release(tag)

    def waiting(self) -> bool:
        """Whether a fetch waits for its reply (not a quarantined tag: its late reply may never
        come)."""
        return any(r.job is not None for r in self.receiving.values())

    def readers_waiting(self) -> bool:
        """Whether a trio task (a READ, not a read-ahead thread) waits for a reply."""
        return any(r.job is not None and r.job.waiter is None for r in self.receiving.values())

    def take_all(self, status: Any) -> bool:
        """Take what arrived of every reply; True if anything moved."""
        busy = False
        for tag, rec in list(self.receiving.items()):
            busy |= self._take(tag, rec, status)
        if self._unfinished:
            self._unfinished = [(r, b) for r, b in self._unfinished if not self._complete_now(r)]
        return busy

    def close(self, sends: Sequence[tuple[Any, Any]] = ()) -> None:
        """The transport stops: wait at most SETTLE_S for every receive still active and for
        `sends` (request, buffer) to complete, and keep what MPI still holds for the life of
        the process."""
        pending = list(self._unfinished) + list(sends)
        for rec in self.receiving.values():
            pending += rec.unfinished(self._complete_now)
        self.receiving.clear()
        self._unfinished = []
        deadline = time.monotonic() + SETTLE_S
        while pending and time.monotonic() < deadline:
            pending = [(r, b) for r, b in pending if not self._complete_now(r)]
            if pending:
                time.sleep(0.001)
        if pending:
            log.warning("%d MPI transfers still active at the stop: their buffers are kept",
                        len(pending))  # fmt: skip
            for req, buf in pending:
                leave_to_mpi(req, buf)

    def _complete_now(self, req: Any) -> bool:
        try:
            return bool(req.Test())
        except self.MPI.Exception:
            return True  # (an error completes it too)

    def probe(self, source: int, tag: int, status: Any, buf: np.ndarray) -> int | None:
        """The size of the next message from `source` with `tag`, taken into `buf` if it is
        exactly `buf`'s size (else dropped, or left unreceived if large); None if none, -1 if
        it could not be taken."""
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
            self._malformed()
            log.warning("a message with tag %d could not be taken: %s", tag, e)
            return -1

    def _discard(self, msg: Any, size: int) -> None:
        """Take a message that is not what was asked for and drop it, if it is small enough to
        take; a larger one stays where it is (its sender holds it). Not waited for: a large
        one's sender killed mid-send leaves its receive unfinished for good (Open MPI), which
        hung this thread; it is kept with the receives MPI has not completed."""
        if 0 <= size <= DISCARD_MAX:
            buf = bytearray(max(size, 1))
            req = msg.Irecv([buf, size, self.MPI.BYTE])
            if not self._complete_now(req):
                self._unfinished.append((req, buf))

    def _take(self, tag: int, rec: _Incoming, status: Any) -> bool:
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
                    rec.matched(size)
                    continue
                want = min(CHUNK, job.length - rec.got)
                if size == 0 and rec.got == 0:  # a refusal (or a ping's answer)
                    msg.Recv([bytearray(1), 0, MPI.BYTE])
                    return self._complete(tag, job, 0)
                if size != want:  # not what was asked: not this peer's bytes
                    self._discard(msg, size)
                    self._malformed()
                    log.warning("a reply of %d bytes from rank %d, %d asked", size, rec.peer,
                                want)  # fmt: skip
                    self._quarantine(rec)
                    self._deliver(job, -2)
                    return True
                view = memoryview(job.buf)[rec.got : rec.got + size]
                rec.matched(size, msg.Irecv(view), view)
            done = bool(MPI.Request.Testall(rec.reqs)) if rec.reqs else True
        except MPI.Exception as e:
            log.warning("bad reply from rank %d: %s", rec.peer, e)
            if job is not None:
                self._quarantine(rec)
                self._deliver(job, -1)
            return True
        if job is None:  # drained, or its peer is quiet too long: the tag is free again
            if (done and (rec.replied or rec.got >= rec.expect)) or time.monotonic() > rec.until:
                # (Receives of matched messages still active are kept until MPI completes
                # them: the tag is free, their messages are theirs already.)
                self._unfinished += rec.unfinished(self._complete_now)
                del self.receiving[tag]
                self._release(tag)
            return moved
        if done and rec.got == job.length and job.length > 0:
            return self._complete(tag, job, job.length)
        return moved

    def _complete(self, tag: int, job: Fetch, count: int) -> bool:
        del self.receiving[tag]
        self._release(tag)
        self._deliver(job, count)
        return True

    def _quarantine(self, rec: _Incoming) -> None:
        """The fetch is over but its peer may still send: drain what comes, then free the tag
        (or after QUARANTINE_TIMEOUTS peer timeouts)."""
        rec.quarantine(time.monotonic() + QUARANTINE_TIMEOUTS * self.peer_timeout)
