"""This daemon's fetches over MPI: what it asks of peers, each handed as a command to the one
thread that owns MPI (mpi.py), and the waits for their replies.

A fetch (`fetch` for a trio task, `fetch_blocking` for a thread of the daemon's own) reserves a
reply tag, posts a `Send` and waits at most the peer timeout; a fetch that gave up posts a
`Cancel`, and the MPI thread drains its late reply before the tag is used again (inbox.py). A
planner's batch (`fetch_batch_blocking`: the whole stored bytes of up to BATCH_MAX files `peer`
holds, in one round trip) is one such fetch with one reply, the files back to back. A peer
that does not answer in time is dead from then on (PeerTimeout); a batch that does not is
only slow, and its files are asked for one by one.

Concurrency: `fetch` in the trio thread, `fetch_blocking` and `fetch_batch_blocking` in any
other thread but the MPI thread's; reply tags and counters change under locks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from fanfs.node.transport import PeerTimeout, PeerTransport, Served
from fanfs.node.transport.commands import Cancel, Command, Send
from fanfs.node.transport.inbox import (
    BATCH_MAX,
    MAX_REQUEST,
    TAG_BATCH,
    TAG_REQUEST,
    Fetch,
    ReplyTags,
    batch_header,
    request_header,
)
from fanfs.world import CHUNK


class MpiFetches(PeerTransport):
    blocking_fetch = True
    batches = True

    def __init__(self, rank: int, size: int, peer_timeout: float, server: Served, tag_ub: int):
        """`tag_ub`: the largest MPI tag (reply tags cycle below it)."""
        super().__init__(rank, size, peer_timeout, server)
        self._tag_ub = tag_ub
        self._tags = ReplyTags(tag_ub)
        self._lock = threading.Lock()  # counters: the event loop and threads

    def _post(self, cmd: Command) -> None:
        """Queue a command for the MPI thread and wake it (any thread): mpi.py's."""
        raise NotImplementedError

    def _call_trio(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` in the event loop, soon, without waiting for it: mpi.py's."""
        raise NotImplementedError

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
        the event loop."""
        if job.waiter is not None:
            job.finish(count)
        else:
            self._call_trio(job.finish, count)
