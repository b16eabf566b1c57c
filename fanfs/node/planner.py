"""Planned epochs, the read-ahead engine: the files of every plan read ahead of the job.

`Plans` (fanfs/node/plans.py) says what is due, within the budget; this engine reads it. One trio
task takes what is due and hands it to PUSH_THREADS threads, which fetch the stored bytes
(fanfs/node/sources.py's blocking side: the staged partition, a peer, or the image), check them,
decode them and store them straight into the kernel's page cache (`push`, notify_store), so
the job's READ never reaches the daemon. A file stored whole in a partition staged here is read,
checked, decoded and stored by the C in the thread, with no Python per byte
(fanfs/node/planner_c.py), and so is a peer's small file the data plane fetches (below). A whole
file the kernel cannot take yet (it has not looked up its inode) goes back to the event loop
to wait in `Plans` for its READ. A framed file is read frame by frame, each frame decoded and
stored at its offset, up to the bytes `Plans` planned for it: memory never holds more than one
frame per thread.

With the front (fanfs/csrc/front.c) running, the job's LOOKUPs and READs are answered in C,
except READs of files whose bytes wait here (`NativePool.held`): the front records the files
it answered, and `_follow` moves the plans with them. A file being read ahead is marked so
that its LOOKUP starts no second read of it (`NativePool.ahead`).

A peer's small file is not fetched alone: it waits in its peer's queue, and the pusher whose
turn comes takes everything waiting for that peer (up to BATCH_MAX files) in one round trip
(`Sources.batch_blocking`, as AIStore's GetBatch does). While the pushers are busy the queues
fill and the batches grow; when idle a batch is one file. Where the data plane
(fanfs/csrc/plane.c) takes a turn's files, `_together` asks their holders together through it
and the C stores each (fanfs_pool_push_files): no Python on either side.

It degrades to reading without a plan: a read-ahead that fails (a dead peer, a corrupt file)
is counted and left to the job's READ, which tries every source and reports it; the engine
never makes a read wrong or makes a READ wait.

Concurrency: `run` is a trio task; the pusher threads share only the job queue, the counters
(under a lock) and read-only looks at `Plans` (`current`). A store into the page cache may wait
for the reply to a READ of the same file, which the event loop sends: never store from the
event loop's thread, and stop the engine (`stop`) before the FUSE session ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from fanfs.image import catalog as cat
from fanfs.image import codec
from fanfs.node.planner_c import CReads, stored_in_c
from fanfs.node.plans import Plans, Share
from fanfs.node.pool import NativePool
from fanfs.node.sources import Sources
from fanfs.node.transport.inbox import BATCH_MAX
from fanfs.threads import name_os_thread

log = logging.getLogger(__name__)

# Threads that read, decode and store: enough to keep a disk and the peers busy on a small
# node; each holds at most one whole file (raw up to the reader's WHOLE_FILE_LIMIT, compressed
# up to the catalog's limit) or one frame.
PUSH_THREADS = 8
DUE_PER_TURN = 256  # positions taken per turn of the event loop (a large plan never stalls it)
FOLLOWED_PER_TURN = 256  # files the front answered, followed per turn of the event loop
# A pusher ends its store within this: it waits for a READ at most, or for a peer's file at
# most 5 s (csrc/remote.c: REMOTE_AHEAD_WAIT_NS; the pool must not clear a slot it holds).
STOP_TIMEOUT_S = 30.0
# A peer's file stored whole in up to this many bytes is fetched in a batch with the others the
# same peer holds and the plan wants now (one round trip for up to BATCH_MAX files, at most
# BATCH_BYTES stored bytes: inbox.MAX_REQUEST is 16 MiB).
BATCH_FILE_LIMIT = 1 << 20
BATCH_BYTES = 8 << 20

# (share, its plan, position, entry, decoded bytes to read ahead)
Job = tuple[int, Share, int, int, int]
Push = Callable[[int, int, bytes], bool]  # (entry, offset, data) -> stored in the page cache


@dataclass(frozen=True, slots=True)
class _PeerTurn:
    """A pusher's turn to fetch, in one batch, what waits for `peer`."""

    peer: int


class ReadAhead:
    def __init__(self, catalog: cat.Catalog, plans: Plans, sources: Sources, push: Push,
                 cached: Callable[[int], bool], pool: NativePool):  # fmt: skip
        """`push(entry, offset, data)`: store bytes of a file in the kernel's page cache,
        False when the kernel does not know its inode; `cached(entry)`: whether the reader
        holds the file's decoded bytes already; `pool`: the native pool, whose front answers
        LOOKUPs and READs with no Python (it tells which files it did, `followed`, and is told
        which files are being read ahead, `ahead`)."""
        self.catalog = catalog
        self.plans = plans
        self.sources = sources
        self.push = push
        self.cached = cached
        self.pool = pool
        self._jobs: queue.SimpleQueue[Job | _PeerTurn | None] = queue.SimpleQueue()
        # Per peer, the read-aheads of files it holds that wait for a batch: each was queued
        # with a _PeerTurn behind it, so no job waits without a turn to come.
        self._for_peer: dict[int, deque[Job]] = {}
        self._count = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope = trio.CancelScope()
        self._finished = trio.Event()
        self._threads: list[threading.Thread] = []
        self.c = CReads(catalog, sources, pool)  # the C path (fanfs/node/planner_c.py)
        self.prefetched = 0
        self.pushed = 0
        self.prefetched_bytes = 0
        self.failed = 0
        self.in_c = 0  # of the pushed, files read, checked, decoded and stored by the C alone
        self.from_peers = 0  # ... of them peers' files (fetched as the front's: the data plane)
        self.together = 0  # ... of those, fetched in a turn of several (`_together`)
        self.followed = 0  # files the front answered and told of

    async def run(self) -> None:
        """Read ahead of every share until cancelled or stopped."""
        self._token = trio.lowlevel.current_trio_token()
        self.c.open()
        self._threads = [threading.Thread(target=self._pusher, name=f"fanfs-plan-{i}",
                                          daemon=True) for i in range(PUSH_THREADS)]  # fmt: skip
        for t in self._threads:
            t.start()
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._follow)
                    while True:
                        due = self.plans.due(DUE_PER_TURN)
                        for job in due:
                            if not self.plans.has(job[3]) and not self.cached(job[3]):
                                self._queue(job)
                        if due or self.plans.scanning:
                            await trio.lowlevel.checkpoint()  # let READs in between
                        else:
                            await self.plans.changed()
        finally:
            for _ in self._threads:
                self._jobs.put(None)
            self._finished.set()

    def _queue(self, job: Job) -> None:
        entry = job[3]
        if not self.c.direct(entry):  # (the C reads those with O_DIRECT when they are due)
            self.sources.local.advise(entry)  # the disk starts on it now
        self.pool.ahead(entry, True)
        peer = self._batch_peer(entry)
        if peer is None:
            self._jobs.put(job)
        else:
            self._for_peer.setdefault(peer, deque()).append(job)
            self._jobs.put(_PeerTurn(peer))

    def _batch_peer(self, entry: int) -> int | None:
        """The peer to fetch `entry` from in a batch, or None (held here, framed, large)."""
        c = self.catalog
        if (not self.sources.batches or self.sources.mine(entry)
                or int(c.codec[entry]) == cat.CODEC_FRAMED
                or int(c.stored_len[entry]) > BATCH_FILE_LIMIT):  # fmt: skip
            return None
        peers = self.sources.peers(entry)
        return peers[0] if peers else None

    async def _follow(self) -> None:
        """Move the plans with the files the front looked up and read with no Python."""
        while True:
            entries, reads = await self.pool.followed()
            self.followed += len(entries)
            for k, (entry, read) in enumerate(zip(entries.tolist(), reads.tolist(), strict=True)):
                if read:
                    self.plans.answered(entry)
                else:
                    self.plans.accessed(entry, None)
                if k % FOLLOWED_PER_TURN == FOLLOWED_PER_TURN - 1:
                    await trio.lowlevel.checkpoint()  # READs in between
            await trio.lowlevel.checkpoint()

    async def stop(self) -> None:
        """Stop reading ahead and wait until no pusher thread stores into the page cache any
        more: the daemon calls it before it ends the FUSE session, while READs are still
        answered (a store may wait for the reply to a READ of the same file)."""
        self._scope.cancel()
        if self._token is None:
            return  # never ran
        await self._finished.wait()

        def join() -> None:
            for t in self._threads:
                t.join(STOP_TIMEOUT_S)
                if t.is_alive():
                    log.warning("read-ahead thread %s did not stop in %.0f s", t.name,
                                STOP_TIMEOUT_S)  # fmt: skip

        await trio.to_thread.run_sync(join)
        if not any(t.is_alive() for t in self._threads):
            self.c.close()

    # -- the pusher threads -----------------------------------------------------------------

    def _pusher(self) -> None:
        name_os_thread()
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _PeerTurn):
                self._batch(job.peer)
            else:
                self._one(job)

    def _one(self, job: Job, stored: bytes | None = None, c_reads: bool = True) -> None:
        """Read one file ahead (`stored`: its checked bytes, from a batch; `c_reads`: by C)."""
        share, s, pos, entry, nbytes = job
        try:
            if not self.plans.current(share, s, pos):
                return  # replaced, or the job passed it meanwhile
            if int(self.catalog.codec[entry]) == cat.CODEC_FRAMED:
                self._framed(entry, nbytes)
            else:
                self._whole(job, stored, c_reads)
        except Exception as e:  # the READ fetches it itself (and reports a corrupt file)
            self._failed(entry, e)
        finally:
            self.pool.ahead(entry, False)

    def _failed(self, entry: int, e: Exception) -> None:
        with self._count:
            self.failed += 1
        log.info("read-ahead of %s failed (its READ will fetch it): %s",
                 os.fsdecode(b"/" + self.catalog.path(entry)), e)  # fmt: skip

    def _batch(self, peer: int) -> None:
        """Fetch what waits for `peer` (up to BATCH_MAX files, BATCH_BYTES) in one round trip,
        then each file as `_one` does; a file the batch did not bring is read the usual way."""
        waiting = self._for_peer[peer]
        jobs: list[Job] = []
        nbytes = 0
        while len(jobs) < BATCH_MAX:
            try:
                job = waiting.popleft()
            except IndexError:
                break
            if not self.plans.current(*job[:3]):
                self.pool.ahead(job[3], False)
                continue
            size = int(self.catalog.stored_len[job[3]])
            if jobs and nbytes + size > BATCH_BYTES:
                waiting.appendleft(job)
                self._jobs.put(_PeerTurn(peer))  # (the turns left may all have passed by)
                break
            jobs.append(job)
            nbytes += size
        if not jobs:
            return  # an earlier turn took them
        if all(self.c.by_plane(job[3]) for job in jobs):  # no Python on either side
            self._together(jobs)
            return
        try:
            got = self.sources.batch_blocking(peer, [job[3] for job in jobs])
        except Exception as e:  # not expected: each file is then read the usual way
            log.warning("a batch from rank %d failed: %s", peer, e)
            got = [None] * len(jobs)
        for job, stored in zip(jobs, got, strict=True):
            self._one(job, stored)

    def _together(self, jobs: list[Job]) -> None:
        """Peers' files the data plane fetches (`CReads.by_plane`), stored as `CReads.push`
        stores each, their fetches asked together; one the C did not store goes `_one`'s Python
        way."""
        try:
            native = [self.c.job(job[3]) for job in jobs]
            done = iter(self.c.push_together([j for j in native if j is not None]))
        except Exception as e:  # not expected: each file is then read the usual way
            log.warning("a turn of %d files could not be asked: %s", len(jobs), e)
            native, done = [None] * len(jobs), iter(())
        for job, one in zip(jobs, native, strict=True):
            entry = job[3]
            try:
                if one is None or not stored_in_c(next(done)):
                    self._one(job, c_reads=False)  # not had in time, or not known to the kernel
                    continue
                self._done(int(self.catalog.size[entry]), True, True, True, len(jobs) > 1)
            except OSError as e:  # its READ fetches it itself (and reports a corrupt file)
                self._failed(entry, e)
            self.pool.ahead(entry, False)

    def _stored(self, entry: int, offset: int, length: int, crc: int | None) -> tuple[bytes, bool]:
        assert self._token is not None
        return self.sources.stored_blocking(entry, offset, length, crc, self._token)

    def _whole(self, job: Job, stored: bytes | None = None, c_reads: bool = True) -> None:
        share, s, pos, entry, _ = job
        c = self.catalog
        if stored is None and c_reads and self.c.push(entry):
            self._done(int(c.size[entry]), True, in_c=True, peer=not self.sources.mine(entry))
            return
        crc = int(c.crc[entry])
        checked = stored is not None
        if stored is None:
            stored, checked = self._stored(entry, 0, int(c.stored_len[entry]), crc)
        data = codec.decode(stored, int(c.codec[entry]), int(c.size[entry]),
                            None if checked else crc, c.dicts)  # fmt: skip
        pushed = self.push(entry, 0, data)
        self._done(len(data), pushed)
        if not pushed and self._token is not None:
            # The kernel does not know the file yet: it waits in memory for its READ.
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self.plans.hold, share, s, pos, entry, data)

    def _framed(self, entry: int, nbytes: int) -> None:
        """The first frames of a framed file, up to `nbytes` decoded, one at a time. Stops at
        the first frame the kernel does not take (then the job's READs fetch them all)."""
        c = self.catalog
        size, stored_len = int(c.size[entry]), int(c.stored_len[entry])
        off, n = codec.FrameTable.span(size, stored_len, c.frame_size)
        raw, checked = self._stored(entry, off, n, int(c.crc[entry]))
        table = codec.FrameTable(raw, size, stored_len, c.frame_size,
                                 None if checked else int(c.crc[entry]))  # fmt: skip
        done, pushed = 0, True
        for i in range(len(table)):
            if done >= nbytes:
                break
            at, length = table.stored(i)
            stored, checked = self._stored(entry, at, length, int(table.crcs[i]))
            data = table.decode(i, stored, checked)
            pushed = self.push(entry, i * table.frame_size, data)
            if not pushed:
                break
            done += len(data)
        self._done(done, pushed)

    def _done(self, nbytes: int, pushed: bool, in_c: bool = False, peer: bool = False,
              together: bool = False) -> None:  # fmt: skip
        with self._count:
            self.prefetched += 1
            self.prefetched_bytes += nbytes
            self.pushed += pushed
            self.in_c += in_c
            self.from_peers += peer
            self.together += together
