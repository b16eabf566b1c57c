"""Planned epochs, the daemon's side: the job's order in, its files read ahead of it.

A training job knows an epoch's order before it reads a byte. `fanfs.plan.publish` (or
`fanfs.torch.PlannedSampler`, or `fanfs plan`) hands that order to the daemon as a *share*
(one per training rank on the node; a new plan for a share replaces its old one). The daemon
then reads the files ahead of the job, in that order, within a memory budget
(`--prefetch-mb`): local ones from the staged partitions, remote ones from their owners, with
PREFETCH_CONCURRENCY fetches at once. A file's decoded bytes go straight into the kernel's
page cache (`notify_store`) when the kernel knows its inode (the job listed the directory, or
looked the file up), so the job's READ never reaches the daemon; otherwise they wait in the
daemon's memory until the READ takes them.

How far ahead: the budget counts the bytes between the job's position in the plan and the
prefetch position. The job's position comes from the READs and LOOKUPs of planned files that
reach the daemon and from progress messages (`PlannedSampler` sends one every plan.PROGRESS_EVERY
samples): files in the page cache send nothing. Prefetched bytes still held in memory when the
job is SLACK positions past them (it read elsewhere, or the plan named files it never read)
are dropped and counted as dropped unread.

It degrades to reading without a plan: reads off the plan, paths not in the image (counted as
missing), a dead peer (the fetch routes around it like any read) and a failed prefetch (the
READ then fetches the file itself, and a corrupt one is marked bad as always) never make a read
wrong, and a READ never waits for the planner.

The channel: an abstract Unix socket with a random name (nothing in any file system, so nothing
is left behind by a killed daemon), published in the status attribute, which only the user who
mounted can read. Every connection's uid is checked first (SO_PEERCRED: the daemon's own or
root) and another user's is closed at once; the client checks the daemon's the same way
(docs/security.md). One request per connection, a header line then the body (fanfs/plan.py is
the client):

    FANFS-PLAN 1 order SHARE N\\n  then N paths relative to the mount, each ended by NUL
    FANFS-PLAN 1 at SHARE POSITION\\n  the job has read up to POSITION of SHARE's plan

answered with one JSON line: {"planned": k, "missing": m}, {"ok": true} or {"error": "..."}.

Concurrency: the trio thread only; resolving a plan's paths runs in a worker thread (the
catalog is immutable).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

from fanfs import catalog as cat
from fanfs import codec
from fanfs.reader import WHOLE_FILE_LIMIT, Reader
from fanfs.status import PlanStatus
from fanfs.transport import PeerTimeout

log = logging.getLogger(__name__)

MAGIC = b"FANFS-PLAN 1"
HEADER_MAX = 200
MAX_SHARES = 1024
PREFETCH_CONCURRENCY = 8
# Threads that read local raw files and store them into the page cache, off the event loop's
# thread (a store may wait for the reply to a READ of the same file, which that thread sends).
PUSH_THREADS = 8
SLACK = 256  # positions behind the job's before held bytes count as dropped unread
REQUEST_TIMEOUT_S = 120.0  # a client that stops sending mid-plan is dropped
PATH_MAX = 4096  # bytes of a path (Linux's limit)
PLAN_FILE_LIMIT = 1 << 30  # stored bytes of a file the planner reads ahead (larger: not)
STOP_TIMEOUT_S = 30.0  # a pusher thread ends its store within this (it waits for a READ at most)


def default_budget() -> int:
    """A tenth of the memory available now, between 64 MiB and 4 GiB."""
    avail = 1 << 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(64 << 20, min(4 << 30, avail // 10))


class PlanError(Exception):
    """A plan request that cannot be taken (its message goes back to the client)."""


@dataclass
class _Share:
    order: np.ndarray  # entries, in the job's order
    ends: np.ndarray  # ends[i]: stored bytes of order[:i+1] that the planner reads ahead
    position: int = 0  # the job has read (or passed) order[:position]
    next: int = 0  # next position to read ahead
    held: set[int] = field(default_factory=set)  # positions whose bytes wait in memory
    swept: int = 0  # positions before this have had their held bytes dropped

    def ahead_bytes(self) -> int:
        def upto(i: int) -> int:
            return int(self.ends[i - 1]) if i > 0 else 0

        return upto(self.next) - upto(min(self.position, self.next))


_Job = tuple[int, _Share, int, int, int, int, int, int]


class Planner:
    def __init__(
        self,
        catalog: cat.Catalog,
        reader: Reader,
        budget: int,
        push: Callable[[int, bytes], bool],
    ):
        """`push(entry, data)`: store a whole file's bytes in the kernel's page cache; False
        when the kernel does not know its inode (the bytes then wait in `reader.held`)."""
        self.catalog = catalog
        self.reader = reader
        self.budget = budget
        self.push = push
        self._shares: dict[int, _Share] = {}
        n = catalog.n_entries
        self._share_of = np.full(n, -1, dtype=np.int32)  # latest plan naming each entry
        self._pos_of = np.full(n, -1, dtype=np.int64)
        self._wake = trio.Event()
        self._slots = trio.Semaphore(PREFETCH_CONCURRENCY)
        self._pushers = trio.CapacityLimiter(PUSH_THREADS)
        # (share, its plan, position, entry, partition, start, length, crc) for the pushers
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._count = threading.Lock()  # counters shared with the pusher threads
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope = trio.CancelScope()
        self._finished = trio.Event()
        self._threads: list[threading.Thread] = []
        self.planned = 0
        self.missing = 0
        self.prefetched = 0
        self.pushed = 0
        self.prefetched_bytes = 0
        self.hits = 0
        self.misses = 0
        self.dropped_unread_bytes = 0
        self.failed = 0
        self.refused = 0
        reader.on_access = self.accessed

    # -- plans and progress ------------------------------------------------------------------

    def take(self, share: int, entries: np.ndarray) -> None:
        """Replace `share`'s plan with `entries` (files of the image, in order)."""
        old = self._shares.pop(share, None)
        if old is not None:
            self._drop_held(old, len(old.order))
        c = self.catalog
        stored = c.stored_len[entries].astype(np.int64)
        wanted = c.is_file[entries] & (stored <= PLAN_FILE_LIMIT)
        wanted &= ~((c.codec[entries] == cat.CODEC_RAW) & (stored > WHOLE_FILE_LIMIT))
        ends = np.cumsum(np.where(wanted, stored, 0))
        self._shares[share] = _Share(entries, ends)
        self._share_of[entries] = share
        self._pos_of[entries] = np.arange(len(entries))
        self.planned += len(entries)
        self._wake.set()

    def progress(self, share: int, position: int) -> None:
        s = self._shares.get(share)
        if s is not None and position > s.position:
            s.position = min(position, len(s.order))
            self._drop_held(s, s.position - SLACK)
            self._wake.set()

    def accessed(self, entry: int, hit: bool | None) -> None:
        """A LOOKUP (`hit` None) or a READ of `entry` reached the daemon, answered from bytes
        read ahead (`hit`) or not: the job is there in its plan."""
        share = int(self._share_of[entry])
        s = self._shares.get(share)
        if s is None:
            return
        pos = int(self._pos_of[entry])
        if 0 <= pos < len(s.order) and int(s.order[pos]) == entry:
            self.misses += hit is False
            self.progress(share, pos + 1)

    def _drop_held(self, s: _Share, before: int) -> None:
        """Drop what is held for positions before `before` (each position looked at once)."""
        if not s.held:
            s.swept = max(s.swept, before)
            return
        for pos in range(s.swept, before):
            if pos in s.held:
                s.held.discard(pos)
                data = self.reader.held.pop(int(s.order[pos]), None)
                if data is not None:
                    self.reader.held_bytes -= len(data)
                    self.dropped_unread_bytes += len(data)
        s.swept = max(s.swept, before)

    # -- reading ahead ----------------------------------------------------------------------

    async def run(self) -> None:
        """Read ahead of every share until cancelled or stopped."""
        self._token = trio.lowlevel.current_trio_token()
        threads = [threading.Thread(target=self._pusher, name=f"fanfs-plan-{i}", daemon=True)
                   for i in range(PUSH_THREADS)]  # fmt: skip
        self._threads = threads
        for t in threads:
            t.start()
        try:
            with self._scope:
                await self._read_ahead()
        finally:
            for _ in threads:
                self._jobs.put(None)
            self._finished.set()

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

    async def _read_ahead(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                self._wake = trio.Event()  # before looking: a progress meanwhile counts
                started = False
                for share, s in list(self._shares.items()):
                    per_share = self.budget // max(1, self._active())
                    while s.next < len(s.order) and s.ahead_bytes() < per_share:
                        pos = s.next
                        s.next += 1
                        if pos < s.position or not self._wanted(s, pos):
                            continue
                        started = True
                        entry = int(s.order[pos])
                        where = self._plain(entry)
                        if where is not None:
                            self.reader.advise(where[0], where[1], where[2])
                            self._jobs.put((share, s, pos, entry, *where))
                            continue
                        await self._slots.acquire()
                        nursery.start_soon(self._fetch_one, share, s, pos)
                if not started:
                    await self._wake.wait()

    def _plain(self, entry: int) -> tuple[int, int, int, int] | None:
        """(partition, start, stored length, codec) of a whole file that a pusher thread
        fetches, checks, decodes and stores into the page cache with no event loop: held here
        (partition -1: by a peer, when the transport can fetch for a thread). None for the rest
        (framed files, files held in memory or cached here, peers only the event loop reaches)."""
        c = self.catalog
        codec_id = int(c.codec[entry])
        if codec_id == cat.CODEC_FRAMED or self.reader.has(entry):
            return None
        length = int(c.stored_len[entry])
        where = self.reader.locate(entry, 0, length)
        if where is not None:
            return where[0], where[1], length, codec_id
        transport = self.reader.sources.transport
        if transport is not None and transport.blocking_fetch and not self.reader.mine(entry):
            return -1, 0, length, codec_id
        return None

    def _pusher(self) -> None:
        """A pusher thread: whole files from the store or a peer into the page cache. A file
        the kernel does not know goes to the event loop to be held; a bad one, or one no
        source gives, is left to its READ (which tries every source and reports it)."""
        c = self.catalog
        while (job := self._jobs.get()) is not None:
            share, s, pos, entry, part, start, length, codec_id = job
            if self._shares.get(share) is not s or pos < s.position - SLACK:
                continue  # replaced, or the job passed it meanwhile
            try:
                if part >= 0:
                    stored = self.reader.pread(part, start, length)
                else:
                    stored = self._from_peers(entry, length)
                data = codec.decode(stored, codec_id, int(c.size[entry]), int(c.crc[entry]),
                                    c.dicts)  # fmt: skip
                pushed = self.push(entry, data)
            except Exception as e:
                self._failed(entry, e)
                continue
            self._done(len(data), pushed)
            if not pushed and self._token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(self._hold, share, s, pos, entry, data)

    def _from_peers(self, entry: int, length: int) -> bytes:
        transport = self.reader.sources.transport
        assert transport is not None
        for peer in self.reader.sources.peers(entry):
            with contextlib.suppress(PeerTimeout):
                got = transport.fetch_blocking(peer, entry, 0, length)
                if got is not None:
                    return got
        raise OSError(errno.EIO, "no peer has it")

    def _done(self, nbytes: int, pushed: bool) -> None:
        """Count a file read ahead (from the event loop or a pusher thread)."""
        with self._count:
            self.prefetched += 1
            self.prefetched_bytes += nbytes
            self.pushed += pushed

    def _failed(self, entry: int, error: Exception) -> None:
        with self._count:
            self.failed += 1
        log.info("read-ahead of %s failed (its READ will fetch it): %s",
                 os.fsdecode(b"/" + self.catalog.path(entry)), error)  # fmt: skip

    def _hold(self, share: int, s: _Share, pos: int, entry: int, data: bytes) -> None:
        if self._shares.get(share) is s and pos >= s.position - SLACK:
            self.reader.hold(entry, data)
            s.held.add(pos)

    def _active(self) -> int:
        """Shares whose job has not read its whole plan (they split the budget)."""
        return sum(1 for s in self._shares.values() if s.position < len(s.order))

    def _wanted(self, s: _Share, pos: int) -> bool:
        before = int(s.ends[pos - 1]) if pos else 0
        return int(s.ends[pos]) > before  # a file the planner reads ahead (not empty, not huge)

    async def _fetch_one(self, share: int, s: _Share, pos: int) -> None:
        entry = int(s.order[pos])
        try:
            if self.reader.has(entry):
                return
            data = await self.reader.whole(entry)
            if self._shares.get(share) is not s or pos < s.position - SLACK:
                return  # replaced, or the job passed it meanwhile
            # Never from the event loop's thread: storing into a page that a READ of the same
            # file holds locked waits for that READ's reply, which the event loop must send.
            pushed = await trio.to_thread.run_sync(self.push, entry, data, limiter=self._pushers)
            self._done(len(data), pushed)
            if not pushed:
                self._hold(share, s, pos, entry, data)
        except Exception as e:  # the READ fetches it itself (and marks it bad if it is)
            self._failed(entry, e)
        finally:
            self._slots.release()

    # -- the socket -------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        """Take plans until cancelled; `started` with the socket's name ("@" + abstract name)."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:  # a random name: nobody can take it first (and a clash only costs a retry)
            name = f"fanfs-plan-{os.getpid()}-{secrets.token_hex(16)}"
            try:
                await sock.bind("\0" + name)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
        sock.listen(64)
        task_status.started("@" + name)
        await trio.serve_listeners(self._client, [trio.SocketListener(sock)])

    async def _client(self, stream: trio.SocketStream) -> None:
        async with stream:
            await self._answer(stream)

    async def _answer(self, stream: trio.SocketStream) -> None:
        reply: dict[str, object]
        try:
            self._check_peer(stream.socket)  # first: another user's connection ends at once
            with trio.fail_after(REQUEST_TIMEOUT_S):
                reply = await self._request(stream)
        except PlanError as e:
            self.refused += 1
            reply = {"error": str(e)}
        except trio.TooSlowError:
            self.refused += 1
            reply = {"error": f"request not complete after {REQUEST_TIMEOUT_S:.0f} s"}
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        with _quietly():
            await stream.send_all(json.dumps(reply).encode() + b"\n")

    def _check_peer(self, sock: trio.socket.SocketType) -> None:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid not in (os.geteuid(), 0):
            raise PlanError(f"uid {uid} may not plan for this mount")

    async def _request(self, stream: trio.SocketStream) -> dict[str, object]:
        buf = bytearray()
        while b"\n" not in buf:
            chunk = await stream.receive_some(4096)
            if not chunk:
                raise PlanError("no request header")
            buf += chunk
            if len(buf) > HEADER_MAX and b"\n" not in buf[:HEADER_MAX]:
                raise PlanError("request header too long")
        header, _, rest = bytes(buf).partition(b"\n")
        kind, share, n = parse_header(header)
        if kind == "at":
            self.progress(share, n)
            return {"ok": True}
        if n > 4 * max(1, int(self.catalog.is_file.sum())):
            raise PlanError(f"{n} paths: more than four per file of the image")
        if len(self._shares) >= MAX_SHARES and share not in self._shares:
            raise PlanError(f"at most {MAX_SHARES} shares")
        limit = n * (PATH_MAX + 1)
        body = bytearray(rest)
        while body.count(0) < n:
            if len(body) > limit:
                raise PlanError("paths longer than the image allows")
            chunk = await stream.receive_some(1 << 20)
            if not chunk:
                raise PlanError(f"plan ended after {body.count(0)} of {n} paths")
            body += chunk
        entries, missing = await trio.to_thread.run_sync(self._resolve, bytes(body), n)
        self.take(share, entries)
        self.missing += missing
        return {"planned": len(entries), "missing": missing}

    def _resolve(self, body: bytes, n: int) -> tuple[np.ndarray, int]:
        """Entries of the plan's paths (files only), and how many named nothing readable."""
        paths = body.split(b"\0")[:n]
        found = [self.catalog.resolve(p) for p in paths]
        entries = [e for e in found if e is not None and self.catalog.is_file[e]]
        return np.array(entries, dtype=np.int64), n - len(entries)

    def statistics(self) -> PlanStatus:
        shares = list(self._shares.values())
        return PlanStatus(
            shares=len(shares),
            planned=self.planned,
            missing=self.missing,
            position=sum(s.position for s in shares),
            prefetched=self.prefetched,
            pushed_to_kernel=self.pushed,
            prefetched_bytes=self.prefetched_bytes,
            held_bytes=self.reader.held_bytes,
            hits=self.reader.held_hits,
            misses=self.misses,
            dropped_unread_bytes=self.dropped_unread_bytes,
            failed=self.failed,
            refused=self.refused,
            budget_bytes=self.budget,
        )


def parse_header(header: bytes) -> tuple[str, int, int]:
    """(kind, share, n) of a request header; PlanError if it is not one."""
    parts = header.split(b" ")
    if len(parts) != 5 or b" ".join(parts[:2]) != MAGIC or parts[2] not in (b"order", b"at"):
        raise PlanError("not a fanfs plan request")
    try:
        share, n = int(parts[3]), int(parts[4])
    except ValueError:
        raise PlanError("share and count must be integers") from None
    if not (0 <= share < 1 << 31 and 0 <= n < 1 << 40):
        raise PlanError("share or count out of range")
    return parts[2].decode(), share, n


def _quietly() -> contextlib.suppress:
    """For replies to a client that may have gone."""
    return contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError)
