"""The MPI transport's server side: answering the peers' requests and batches.

A peer's request that a plain read answers (the server's `locate`) is served without the event
loop: the MPI thread reads what the page cache holds (up to INLINE_READ_LIMIT), SERVER_THREADS
threads read the rest from the disk, and both put the reply on the MPI thread's command queue
(`post`). Other requests (refusals, large raw files not checked yet) go to the server's
`serve` in the event loop. A batch (the whole stored bytes of up to BATCH_MAX files) is read by
a server thread, or refused whole if one file is not a plain read here or the reply would pass
MAX_REQUEST. A request for more than MAX_REQUEST, or while more than REPLY_BYTES of replies
wait for their requesters, is refused with an empty reply.

Concurrency: `request`, `batch` and `sent` run in the MPI thread, which alone counts the
reply bytes reserved; the server threads only read and post; `_answer` runs in the event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from fanfs.node.transport import Served
from fanfs.node.transport.commands import Command, Read, Reply
from fanfs.node.transport.inbox import (
    BATCH_HEADER,
    MAX_REQUEST,
    TAG_BATCH,
    TAG_REQUEST,
    Inbox,
    parse_batch,
    parse_request,
)
from fanfs.threads import name_os_thread

log = logging.getLogger(__name__)

# Peers' requests that a plain read answers never pass through the event loop: bytes the page
# cache holds (up to this size) are read by the MPI thread itself, the rest by this many server
# threads, which hand the reply straight back to the MPI thread.
INLINE_READ_LIMIT = 1 << 20
SERVER_THREADS = 4
# Bytes of replies that may wait for their requesters at once (a requester that gave up never
# takes its reply, which then stays in the sender's memory): beyond, new requests are refused.
REPLY_BYTES = 64 << 20


# The event loop's answer to a request: serve(peer, entry, offset, length) -> bytes or None.
Serve = Callable[[int, int, int, int], Awaitable[bytes | memoryview | None]]


class Answers:
    def __init__(self, server: Served, post: Callable[[Command], None],
                 call_trio: Callable[..., None], serve: Serve):  # fmt: skip
        """`post` queues a command for the MPI thread (any thread); `call_trio` runs a function
        in the event loop; `serve(peer, entry, offset, length)` answers a request there."""
        self.server = server
        self._post = post
        self._call_trio = call_trio
        self._serve = serve
        self._reads: queue.SimpleQueue[Read | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._nursery: trio.Nursery | None = None
        self.reply_bytes = 0  # bytes of replies not yet sent (the MPI thread's)
        self._header = np.empty(4, dtype=np.int64)  # a request's, taken into (the MPI thread's)
        self._batch = np.empty(BATCH_HEADER, dtype=np.int64)  # a batch's
        # The owner's side of the latency budget (the MPI thread's; read by others as ints):
        # requests answered without the event loop, the nanoseconds from taking each to its
        # read begun (queued for a server thread), of the read, and from then to its send
        # posted (the MPI thread's turn).
        self.timed = self.queue_ns = self.read_ns = self.post_ns = 0

    def start(self, nursery: trio.Nursery) -> None:
        """Start the server threads; requests for the event loop go to `nursery`."""
        self._nursery = nursery
        for i in range(SERVER_THREADS):
            t = threading.Thread(target=self._reader, name=f"fanfs-serve-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        for _ in self._threads:
            self._reads.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def take(self, inbox: Inbox, status: Any, any_source: int, tag_ub: int,
             malformed: Callable[[], None]) -> bool:  # fmt: skip
        """(The MPI thread.) Take and answer every pending request and batch (`malformed()`
        for each dropped); True if any came."""
        busy = self._take(inbox, status, any_source, tag_ub, malformed, TAG_REQUEST,
                          self._header, parse_request, self.request)  # fmt: skip
        return self._take(inbox, status, any_source, tag_ub, malformed, TAG_BATCH,
                          self._batch, parse_batch, self.batch) or busy  # fmt: skip

    def _take(self, inbox: Inbox, status: Any, any_source: int, tag_ub: int,
              malformed: Callable[[], None], tag: int, buf: np.ndarray,
              parse: Callable[[np.ndarray, int], tuple[Any, ...] | None],
              answer: Callable[..., None]) -> bool:  # fmt: skip
        """Take every pending message with `tag` into `buf`, each checked by `parse` and
        answered by `answer(peer, *parsed)`; True if any came."""
        busy = False
        while (size := inbox.probe(any_source, tag, status, buf)) is not None:
            busy = True
            if size < 0:
                break  # (could not be taken, and counted: the next turn tries again)
            peer = status.Get_source()
            asked = parse(buf, tag_ub) if size == buf.nbytes else None
            if asked is not None:
                answer(peer, *asked)
            else:
                malformed()
                log.warning("malformed message (tag %d, %d bytes) from rank %d ignored", tag,
                            size, peer)  # fmt: skip
        return busy

    def posted(self, reply: Reply) -> None:
        """(The MPI thread.) A reply's send is posted: its times go to the budget."""
        if reply.taken_ns and reply.ready_ns:
            self.timed += 1
            self.queue_ns += reply.started_ns - reply.taken_ns
            self.read_ns += reply.ready_ns - reply.started_ns
            self.post_ns += time.monotonic_ns() - reply.ready_ns

    def budget(self) -> dict[str, int]:
        return {"owner_n": self.timed, "owner_queue_ns": self.queue_ns,
                "owner_read_ns": self.read_ns, "owner_post_ns": self.post_ns}  # fmt: skip

    def sent(self, reserved: int) -> None:
        """(The MPI thread.) A reply is out (or failed): its bytes are no longer reserved."""
        self.reply_bytes -= reserved

    def request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        """Answer a peer's request: a ping at once; a plain read from the page cache here,
        from the disk by a server thread; anything else (a large raw file not checked yet, a
        request to refuse) by the server's `serve` in the event loop. Replies go out through
        the command queue, which the MPI thread reads again before it waits."""
        if entry == -1 and length == 0:
            self._post(Reply(peer, tag, None, entry))
            return
        taken = time.monotonic_ns()
        if length > MAX_REQUEST or self.reply_bytes + length > REPLY_BYTES:
            # Too much at once: refused (the requester tries another source); the bytes are
            # reserved until the reply has been sent, which a requester that gave up never takes.
            self._post(Reply(peer, tag, None, entry))
            return
        self.reply_bytes += length
        located = None
        try:
            located = self.server.locate(entry, offset, length)
            if located is not None and length <= INLINE_READ_LIMIT:
                data = self.server.cached(*located, length)
                if data is not None:
                    self._post(Reply(peer, tag, data, entry, direct=True, reserved=length,
                                     taken_ns=taken, started_ns=taken,
                                     ready_ns=time.monotonic_ns()))  # fmt: skip
                    return
        except Exception as e:  # a disk error: the server thread tries again and reports it
            log.debug("inline read for rank %d failed: %s", peer, e)
        if located is not None:
            self._reads.put(Read(peer, tag, entry, ((*located, length),), taken))
        else:
            self._call_trio(self._on_request, peer, entry, offset, length, tag)

    def batch(self, peer: int, tag: int, entries: list[int]) -> None:
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
                self._post(Reply(peer, tag, None, entry))
                return
            pieces.append(piece)
        total = sum(n for _, _, n in pieces)
        if total > MAX_REQUEST or self.reply_bytes + total > REPLY_BYTES:
            self._post(Reply(peer, tag, None, entries[0]))
            return
        self.reply_bytes += total
        self._reads.put(Read(peer, tag, entries[0], tuple(pieces)))

    def _on_request(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._answer, peer, entry, offset, length, tag)

    async def _answer(self, peer: int, entry: int, offset: int, length: int, tag: int) -> None:
        data = await self._serve(peer, entry, offset, length)
        self._post(Reply(peer, tag, data, entry, reserved=length))

    def _reader(self) -> None:
        """Read what peers asked for that is not in the page cache (may wait for the disk)."""
        name_os_thread()
        while (read := self._reads.get()) is not None:
            started = time.monotonic_ns()
            data: Any = None
            try:
                if len(read.pieces) == 1:
                    data = self.server.pread(*read.pieces[0])
                else:
                    data = b"".join(self.server.pread(*p) for p in read.pieces)
            except OSError as e:
                log.warning("cannot serve entry %d to rank %d: %s", read.entry, read.peer, e)
            except Exception:
                log.exception("serving entry %d to rank %d failed", read.entry, read.peer)
            reserved = sum(n for _, _, n in read.pieces)
            self._post(Reply(read.peer, read.tag, data, read.entry, True, reserved,
                             len(read.pieces), read.taken_ns, started,
                             time.monotonic_ns()))  # fmt: skip
