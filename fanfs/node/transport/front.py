"""The front's fetches of peers' pieces (`native_remote`), done by the MPI thread alone.

The front (fanfs/csrc/front.c) answers READs of files only peers hold without the event loop:
it queues a request for the file's stored bytes and writes the MPI thread's eventfd; the MPI
thread, which owns every MPI call (NoPFS's model), is handed this object and runs `step` each
turn: it takes the new requests (`lib.remote_take`), asks a live holder, and hands the reply
to the C (`lib.remote_fill`: checked, decoded, the waiting READ answered). Which holder to
ask next is fanfs/node/peers.py's (`in_turn`): after a refusal, a bad copy, a dead or silent
holder (after the peer timeout, which `step` watches itself) the next one is asked, and a slow
one is hedged: after the hedge delay another holder is asked too, the first good copy filling
the piece (the other's is ESTALE then). When no holder is left the request is given up
(`lib.remote_fail`) and the READ goes to Python, which also tries the image. So that a silent
peer cannot freeze the mount, at most `waiting` of the front's READs wait for peers at once
(NATIVE_WAITING: one front thread is always left for local files; the others go to Python at
once), each at most the peer timeout. The daemon's assembly makes this object and hands it to
the transport, whose MPI thread `start`s it with itself: the front's fetches are that
transport's fetches (its reply tags, dead peers, hedge delay, latency).

A request crosses the seam as a `FrontRequest` (the C's `fanfs_rreq`, field by field); a fetch
under way carries a `FrontFetch` (which request, which holders were asked, since when, its
reply tag).

Concurrency: the MPI thread only (`step`, `done`, `start`, `stop`); the counters are read by
others (ints: a stale value is only a moment old).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from fanfs.native import lib
from fanfs.node.front import FRONT_THREADS
from fanfs.node.peers import in_turn
from fanfs.node.transport import PeerTimeout
from fanfs.node.transport.commands import Command, Send
from fanfs.node.transport.inbox import Fetch, Inbox, request_header

log = logging.getLogger(__name__)

# The front's READs that may wait for peers' pieces at once: one front thread is always left
# for local files.
NATIVE_WAITING = FRONT_THREADS - 1


class FrontRequest(NamedTuple):
    """A READ's request for a peer's piece, as the front queued it (`lib.remote_take`); handed
    back as a plain tuple to `lib.remote_fill`, `remote_fail` and `remote_pending` (their
    argument is typed `tuple`, which Cython checks exactly)."""

    slot: int
    ahead: int
    entry: int
    part: int
    offset: int
    length: int
    crc: int
    holders: tuple[int, ...]
    queued_ns: int = 0  # CLOCK_MONOTONIC: when the front queued it (the latency budget)
    taken_ns: int = 0  # ... when the MPI thread (or the data plane) took it
    tried: int = -1  # the holder the data plane asked before it handed it back; -1: none


@dataclass(frozen=True, slots=True)
class FrontFetch:
    """A front's request asked of one holder (`Fetch.native`)."""

    request: FrontRequest
    tried: tuple[int, ...]  # the holders asked so far, this one last
    began: float  # perf_counter, for the fetch latency
    tag: int  # its reply tag


@dataclass(frozen=True, slots=True)
class _Out:
    """A fetch out: when to hedge it (inf: hedged already), when to give up on its holder."""

    job: Fetch
    hedge_at: float
    deadline: float


class Asks(Protocol):
    """What the front's fetches use of the transport that owns MPI (MpiTransport)."""

    rank: int
    peer_timeout: float

    def is_dead(self, peer: int) -> bool: ...

    def hedge_delay(self) -> float: ...

    def timed_out(self, peer: int) -> PeerTimeout: ...

    def mark_dead(self, peer: int, why: str) -> None: ...

    def reserve(self) -> int: ...

    def fetched(self, began: float, length: int) -> None: ...


class FrontFetches:
    def __init__(self, waiting: int = NATIVE_WAITING):
        """`waiting`: the front's READs that may wait for peers' pieces at once."""
        self.waiting = waiting
        self._transport: Asks | None = None  # the MPI thread's, from `start`
        self._out: dict[int, _Out] = {}  # reply tag -> the fetch out
        self._retry: list[tuple[FrontRequest, tuple[int, ...]]] = []
        self._asked: dict[FrontRequest, int] = {}  # request -> its fetches out
        self.hedged = 0  # requests asked of another holder too, the first being slow
        self.hedges_won = 0  # ... that the other holder answered first

    @property
    def transport(self) -> Asks:
        assert self._transport is not None, "FrontFetches.start was not called"
        return self._transport

    def start(self, wake: int, transport: Asks) -> None:
        """(The MPI thread, once.) The front writes `wake` (an eventfd) when it queues a
        request; `transport` is the one that owns MPI, whose fetches these are."""
        self._transport = transport
        lib.remote_set_wake(wake, self.waiting, transport.peer_timeout)

    def stop(self) -> None:
        """Every READ waiting for a peer goes to Python."""
        lib.remote_set_wake(-1)
        self._out.clear()
        self._retry.clear()
        self._asked.clear()

    def step(self, inbox: Inbox, command: Callable[[Command], None]) -> bool:
        """Start the front's new requests and the retries, give up on silent holders;
        `command` runs an MPI command now. True if there was anything to do."""
        todo: list[tuple[FrontRequest, tuple[int, ...]]] = []
        for taken in lib.remote_take():
            req = FrontRequest(*taken)
            todo.append((req, (req.tried,) if req.tried >= 0 else ()))
        todo += self._retry
        self._retry = []
        if self._out:
            now = time.monotonic()
            for tag, out in list(self._out.items()):
                native: FrontFetch = out.job.native
                if now > out.deadline:  # silent: dead from now on, the next holder is asked
                    del self._out[tag]
                    self._unask(native.request)
                    inbox.forget(tag)
                    self.transport.timed_out(out.job.peer)
                    todo.append((native.request, native.tried))
                elif now > out.hedge_at:  # slow: another holder is asked too, if there is one
                    self._out[tag] = _Out(out.job, math.inf, out.deadline)
                    if self._holders(native.request, native.tried):
                        self.hedged += 1
                        todo.append((native.request, native.tried))
        for req, tried in todo:
            try:
                self._start(req, tried, inbox, command)
            except Exception:  # not expected: this READ goes to Python, the others go on
                log.exception("fetching entry %d for the front failed", req.entry)
                lib.remote_fail(tuple(req))
        return bool(todo)

    def _holders(self, req: FrontRequest, tried: tuple[int, ...]) -> list[int]:
        t = self.transport
        return in_turn(req.entry, req.holders, t.rank, t.is_dead, tried)

    def _start(self, req: FrontRequest, tried: tuple[int, ...], inbox: Inbox,
               command: Callable[[Command], None]) -> None:  # fmt: skip
        """Ask the next live holder of a front's request for its stored bytes, or give it up."""
        peers = self._holders(req, tried)
        if not peers:
            if req not in self._asked:
                lib.remote_fail(tuple(req))  # (else a hedged fetch still out may yet fill it)
            return
        if not lib.remote_pending(tuple(req)):
            return  # filled meanwhile (a hedge, a retry after a refusal)
        peer = peers[0]
        job = Fetch(peer, req.length, bytearray(req.length))
        tag = self.transport.reserve()
        job.native = FrontFetch(req, (*tried, peer), time.perf_counter(), tag)
        now = time.monotonic()
        self._out[tag] = _Out(job, now + self.transport.hedge_delay(),
                              now + self.transport.peer_timeout)  # fmt: skip
        self._asked[req] = self._asked.get(req, 0) + 1
        try:
            header = request_header(req.entry, 0, req.length, tag)  # its stored bytes
            command(Send(peer, tag, header, job))
        except BaseException:  # (an MPI error is delivered as a dead peer, not raised)
            if self._out.pop(tag, None) is not None:
                self._unask(req)
                inbox.drop(tag)
            raise

    def _unask(self, req: FrontRequest) -> None:
        left = self._asked.pop(req) - 1
        if left:
            self._asked[req] = left

    def done(self, job: Fetch, count: int) -> None:
        """A front's fetch is over: the bytes to the C, or the next holder."""
        native: FrontFetch = job.native
        req, tried = native.request, native.tried
        if self._out.pop(native.tag, None) is None:
            return  # given up on already (its holder timed out)
        self._unask(req)
        if count == job.length:
            err = lib.remote_fill(tuple(req), job.buf)
            if err == 0:
                self.transport.fetched(native.began, job.length)
                self.hedges_won += len(tried) > 1 and req in self._asked  # one is still out
                return
            if err == errno.ESTALE:
                return  # given up meanwhile
            log.warning("bad copy of entry %d from rank %d (%s), asking another holder",
                        req.entry, job.peer, os.strerror(err))  # fmt: skip
        elif count == -1:
            self.transport.mark_dead(job.peer, "cannot be reached")
        self._retry.append((req, tried))
