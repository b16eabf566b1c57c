"""`fanfs output --replicas 2`: each closed file is also held by the next rank until it is at
DEST, so a node that dies before landing it loses nothing that was closed.

Ring: rank r sends copies to its partner r+1 (mod size) and holds copies for r-1. Messages
are bytes (never pickles: a peer's message is data, checked before use; messages.py), one tag,
through the World's point-to-point calls; one MPI thread makes them all:
- owner -> holder: PUT seq, path, mode, piece `part` of `parts` (PIECE bytes each); an op
  (RENAME, UNLINK, MKDIR, RMDIR) with its paths; LANDED seq: every op up to seq is at DEST;
  BYE seq: the owner is done, everything is at DEST; HB every HEARTBEAT_S, so a holder can
  tell a silent owner from a dead one.
- holder -> owner: HELD seq once a put's last piece is on the holder's disk.
A message that breaks the format (a size over MESSAGE_MAX, a bad kind, a path with NUL or
"..", a piece out of range) makes its sender a dead peer: ignored from then on. What a holder
keeps is bounded by its disk (ENOSPC is an error like any other) and MAX_HELD ops.

Every op the journal takes is queued for the partner as it is enqueued (lander.py's hook), so
the partner sees them in the journal's order. A close (FLUSH) that enqueued a put waits for
its "held" (fs.py awaits `replicate`), for at
most the peer timeout plus the time the bytes take at REPLICATE_MB_S: a partner that does not
answer is taken for dead, the file is landed from here as always, and `statistics()` says
copies are no longer kept. A holder keeps an owner's ops (held.py) and forgets them as
"landed" comes.

At the end (`finish`): ops of an owner still not landed are landed by the holder itself, in
their order, into the owner's DEST (every rank's DEST and token are exchanged at start-up),
once the owner is gone (dead: silent for the peer timeout) or has not said "bye" within the
drain time; the owner records at DEST how far it has landed, after each op (dest.py's
marker), so the holder skips what it landed (held.py).

Concurrency: the MPI thread owns every MPI call; trio tasks hand it messages through a
thread-safe queue and it hands back what trio needs with `trio.from_thread.run_sync`. The
holder's files and op list belong to the MPI thread until `finish`, which runs after the MPI
thread has stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from fanfs.node.staging import StagingDir
from fanfs.output.held import Held
from fanfs.output.journal import ATTR, PUT, Op
from fanfs.output.messages import (
    M_BYE,
    M_HB,
    M_HELD,
    M_LANDED,
    M_OPS,
    M_PUT,
    MESSAGE_MAX,
    OPS_M,
    PIECE,
    decode,
    encode,
)
from fanfs.threads import name_os_thread
from fanfs.world import World

log = logging.getLogger(__name__)

TAG = 71  # the output daemons' messages (no other traffic shares their communicator)


IN_FLIGHT = 4  # pieces posted and not delivered at most: MPI buffers at most 32 MiB of them
HEARTBEAT_S = 1.0
REPLICATE_MB_S = 50.0  # the slowest link a close waits for before it takes the partner for dead
IDLE_SLEEP_S = (0.0005, 0.02)  # the MPI thread's poll: quick while busy, backing off when idle


class _Outbox(queue.Queue[tuple[Any, ...]]):
    """What the MPI thread sends: a put wakes it from its poll's sleep (`wait`), so a close
    waits for no sleep of this side (the partner's message still waits for a poll there)."""

    def __init__(self) -> None:
        super().__init__()
        self._kick = threading.Event()

    def put(self, item: tuple[Any, ...], block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self._kick.set()

    def wait(self, timeout: float) -> None:
        self._kick.wait(timeout)
        self._kick.clear()  # (a put after this wakes the next wait; one before is taken next)


class Replicas:
    def __init__(self, world: World, staging: StagingDir, open_local: Callable[[int], int | None],
                 owner_dest: str, owner_token: str, peer_timeout: float,
                 on_sent: Callable[[int, int, int], None] = lambda node, data, size: None,
                 ):  # fmt: skip
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.partner = (self.rank + 1) % self.size  # holds my copies
        self.owner = (self.rank - 1) % self.size  # whose copies I hold
        self.staging = staging
        self._open_local = open_local
        self.on_sent = on_sent  # a put's bytes were read for the partner: (node, data, size)
        self.owner_dest = owner_dest  # where the owner's files land
        self.peer_timeout = peer_timeout
        self.failed = ""  # why the owner's ops could not all be landed from here
        self.dead: set[int] = set()
        self._out = _Outbox()
        self._held: dict[int, tuple[trio.Event, Op]] = {}  # seq -> set when the partner holds it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # The MPI thread's (then finish's): the owner's ops not landed, in order.
        self.held = Held(staging, self.owner, owner_dest, owner_token)
        self.owner_heard = time.monotonic()
        self.owner_done = False
        self.sent_bytes = 0

    @property
    def holding(self) -> list[Op]:
        """The owner's ops held here, not landed, in order."""
        return self.held.ops

    # -- trio side -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._loop, name="fanfs-replicas", daemon=True)
        self._thread.start()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._stop.set()
            await trio.to_thread.run_sync(self._thread.join)

    def enqueued(self, op: Op) -> None:
        """The journal's hook: a new op, for the partner (in the journal's order). A put's
        bytes are held for it until `on_sent` (view.py)."""
        if self.partner in self.dead or self.partner == self.rank:
            if op.kind == PUT:
                self.on_sent(op.node, op.data, op.size)
            return
        if op.kind == PUT:
            self._held[op.seq] = (trio.Event(), op)
        self._out.put(("send", op))

    async def replicate(self, seq: int) -> None:
        """Return once the partner holds put `seq`'s bytes, or once it is taken for dead."""
        waiting = self._held.get(seq)
        if waiting is None:
            return  # confirmed already (or no partner)
        held, op = waiting
        with trio.move_on_after(self.peer_timeout + op.size / (REPLICATE_MB_S * 1e6)):
            await held.wait()
        self._held.pop(seq, None)
        if not held.is_set():
            log.warning("rank %d did not confirm a copy of %s: taken for dead, closed files "
                        "are no longer replicated", self.partner, op.describe())  # fmt: skip
            self.dead.add(self.partner)

    def landed(self, op: Op) -> None:
        """The lander's hook: everything up to `op` is at DEST (the partner may forget)."""
        if self.partner not in self.dead:
            self._out.put(("landed", op.seq))

    def _confirmed(self, seq: int) -> None:
        waiting = self._held.pop(seq, None)
        if waiting is not None:
            waiting[0].set()

    async def finish(self, drain_s: float, all_landed: bool, landed: int) -> None:
        """After the unmount: say bye to the partner if everything of ours is at DEST, and
        wait (at most `drain_s`) for the owner's bye. If it comes, the owner landed all it
        had; if the owner is dead (silent for the peer timeout), land what it left; if it is
        alive and still landing, keep the copies (held.json) and let it finish."""
        if all_landed:
            self._out.put(("bye", landed))
        deadline = trio.current_time() + drain_s
        while self.holding and not self.owner_done and trio.current_time() < deadline:
            if time.monotonic() - self.owner_heard > self.peer_timeout:
                self.dead.add(self.owner)
                break
            await trio.sleep(0.1)
        await trio.sleep(0.2)  # the bye goes out before the MPI thread stops
        self._stop.set()
        if self._thread is not None:
            await trio.to_thread.run_sync(self._thread.join)
        if self.owner_done or not self.holding:
            with contextlib.suppress(OSError):
                await trio.to_thread.run_sync(self.held.remove_marker)
            return
        if self.owner not in self.dead:
            log.warning("rank %d is still landing %d changes: its copies stay in %s (held.json)",
                        self.owner, len(self.holding), self.staging.path)  # fmt: skip
            self.staging.keep_contents()
            return
        with trio.move_on_after(drain_s) as scope:
            await trio.to_thread.run_sync(self._land_owners, abandon_on_cancel=True)
        if scope.cancelled_caught:
            self.failed = f"not done within {drain_s:g} s"
        if self.failed:
            self.staging.keep_contents()

    # -- the MPI thread --------------------------------------------------------------------

    def _loop(self) -> None:
        name_os_thread()
        sleep = IDLE_SLEEP_S[0]
        last_beat = 0.0
        while not self._stop.is_set():
            busy = False
            try:
                while True:
                    item = self._out.get_nowait()
                    busy = True
                    self._send_safely(item)
            except queue.Empty:
                pass
            if time.monotonic() - last_beat > HEARTBEAT_S:
                last_beat = time.monotonic()
                self._post(encode(M_HB), self.partner)
            busy = self._take_incoming() or busy
            sleep = IDLE_SLEEP_S[0] if busy else min(IDLE_SLEEP_S[1], sleep * 2)
            self._out.wait(sleep)
        with contextlib.suppress(queue.Empty):  # a bye queued last
            while True:
                self._send_safely(self._out.get_nowait())

    def _send_safely(self, item: tuple[Any, ...]) -> None:
        """One item; an error (a local file gone bad) is logged, and the thread goes on."""
        try:
            self._send(item)
        except Exception as e:
            log.warning("a message for rank %d was not sent: %s", self.partner, e)
            if item[0] == "send":
                self._confirm_from_thread(item[1].seq)  # nothing to wait for
        finally:
            if item[0] == "send" and item[1].kind == PUT and self._token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(self.on_sent, item[1].node, item[1].data,
                                              item[1].size, trio_token=self._token)  # fmt: skip

    def _post(self, msg: bytes, dest: int) -> None:
        if dest in self.dead or dest == self.rank:
            return
        try:
            self.world.post_bytes(msg, dest, TAG)
            # Bounded memory: wait for the pieces in flight, taking messages meanwhile (the
            # partner may be sending us its own copies and waiting for us likewise).
            quiet = time.monotonic()
            while self.world.in_flight() > IN_FLIGHT:
                if self._take_incoming():
                    quiet = time.monotonic()
                elif time.monotonic() - quiet > self.peer_timeout:
                    raise TimeoutError(f"nothing delivered for {self.peer_timeout:g} s")
                time.sleep(IDLE_SLEEP_S[0])
        except Exception as e:  # an MPI error, or silence: the peer is gone
            log.warning("rank %d unreachable (%s): taken for dead", dest, e)
            self.dead.add(dest)

    def _take_incoming(self) -> bool:
        took = False
        for src in {self.owner, self.partner}:
            while src not in self.dead:
                try:
                    msg = self.world.recv_bytes(src, TAG, MESSAGE_MAX, self.peer_timeout)
                    if msg is None:
                        break
                    took = True
                    self._receive(src, decode(msg))
                except Exception as e:  # a message over the limit, or breaking the format
                    log.warning("rank %d sent a bad message (%s): ignoring it from now on",
                                src, e)  # fmt: skip
                    self.dead.add(src)
        return took

    def _send(self, item: tuple[Any, ...]) -> None:
        what = item[0]
        if what == "send":
            op: Op = item[1]
            if op.kind == ATTR:
                return  # a mode or an mtime: not worth a message (a replay lands without it)
            if op.kind != PUT:
                self._post(encode(M_OPS[op.kind], op.seq, op.path, op.new), self.partner)
                return
            fd = self._open_local(op.data)
            if fd is None:  # unlinked before it could be sent: nothing to keep
                self._confirm_from_thread(op.seq)
                return
            try:
                size = op.size  # the snapshot: bytes after it are a later version's
                parts = max(1, -(-size // PIECE))
                for i in range(parts):
                    data = os.pread(fd, min(PIECE, size - i * PIECE), i * PIECE)
                    self._post(encode(M_PUT, op.seq, op.path, mode=op.mode, part=i, parts=parts,
                                      data=data), self.partner)  # fmt: skip
                    self.sent_bytes += len(data)
            finally:
                os.close(fd)
        elif what == "landed":
            self._post(encode(M_LANDED, item[1]), self.partner)
        elif what == "held":
            self._post(encode(M_HELD, item[1]), self.owner)
        elif what == "bye":
            self._post(encode(M_BYE, item[1]), self.partner)

    def _confirm_from_thread(self, seq: int) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._confirmed, seq, trio_token=self._token)

    def _receive(self, src: int, msg: tuple[int, int, int, int, int, bytes, bytes, memoryview]
                 ) -> None:  # fmt: skip
        kind, seq, part, parts, mode, path, new, data = msg
        if src == self.partner and kind == M_HELD:
            self._confirm_from_thread(seq)
        if src != self.owner:
            return
        self.owner_heard = time.monotonic()
        if kind in OPS_M or (kind == M_PUT and part == 0):
            self.held.check_room(path, new)
        try:
            if kind == M_PUT:
                if self.held.piece(seq, path, mode, part, parts, data):
                    self._out.put(("held", seq))  # from the loop: no post inside a receive
            elif kind in OPS_M:
                self.held.add(Op(seq, OPS_M[kind], path, new))
            elif kind == M_LANDED:
                self.held.forget(seq)
            elif kind == M_BYE:
                self.held.forget(seq)
                self.owner_done = True
        except OSError as e:
            log.warning("rank %d: a copy could not be kept (%s)", src, e)

    def _land_owners(self) -> None:
        """In a worker thread, after the MPI thread stopped: what the owner did not land."""
        failed = self.held.land()
        if failed:  # (a thread `finish` gave up on may end later: it says why, never "")
            self.failed = failed

    def statistics(self) -> dict[str, Any]:
        return {"partner": self.partner, "holding_for": self.owner,
                "held_files": sum(1 for op in self.holding if op.kind == PUT),
                "held_changes": len(self.holding), "sent_bytes": self.sent_bytes,
                "dead": sorted(self.dead), "failed": self.failed}  # fmt: skip
