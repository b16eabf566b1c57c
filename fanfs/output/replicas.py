"""`fanfs output --replicas 2`: each closed file is also held by the next rank until it is at
DEST, so a node that dies before landing it loses nothing that was closed.

Ring: rank r sends copies to its partner r+1 (mod size) and holds copies for r-1. Messages
(pickled, one tag, through the World's point-to-point calls; one MPI thread makes them all):
- owner -> holder: ("put", seq, path, mode, part, parts, bytes) in pieces of PIECE bytes;
  ("op", seq, kind, path, new) for a rename, unlink, mkdir or rmdir; ("landed", seq): every op
  up to seq is at DEST; ("bye", seq): the owner is done, everything is at DEST; ("hb",) every
  HEARTBEAT_S, so a holder can tell a silent owner from a dead one.
- holder -> owner: ("held", seq) once a put's last piece is on the holder's disk.

Every op the journal takes is queued for the partner as it is enqueued (lander.py's hook), so
the partner sees them in the journal's order. A close (FLUSH) that enqueued a put waits for
its "held" (fs.py awaits `replicate`), for at
most the peer timeout plus the time the bytes take at REPLICATE_MB_S: a partner that does not
answer is taken for dead, the file is landed from here as always, and `statistics()` says
copies are no longer kept. A holder keeps an owner's ops in order, each put's bytes in its
staging directory (`r<rank>-<seq>`), and forgets them as "landed" comes.

At the end (`finish`): ops of an owner still not landed are landed by the holder itself, in
their order, once the owner is gone (dead: silent for the peer timeout) or has not said "bye"
within the drain time. Ops are idempotent at DEST (lander.py), so landing one the owner had
landed too ends in the same state. A put whose pieces did not all arrive was never closed by
its writer (the close waits for "held"): it is skipped.

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
from fanfs.output.lander import PUT, LandingError, Op, apply

log = logging.getLogger(__name__)

TAG = 71  # the output daemons' messages (no other traffic shares their communicator)
PIECE = 8 << 20  # bytes per message: bounded memory per message on both sides
IN_FLIGHT = 4  # pieces posted and not delivered at most: MPI buffers at most 32 MiB of them
HEARTBEAT_S = 1.0
REPLICATE_MB_S = 50.0  # the slowest link a close waits for before it takes the partner for dead
IDLE_SLEEP_S = (0.0005, 0.02)  # the MPI thread's poll: quick while busy, backing off when idle


class Replicas:
    def __init__(self, world: Any, staging: StagingDir, open_local: Callable[[int], int | None],
                 dest_fd: int, peer_timeout: float):  # fmt: skip
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.partner = (self.rank + 1) % self.size  # holds my copies
        self.owner = (self.rank - 1) % self.size  # whose copies I hold
        self.staging = staging
        self._open_local = open_local
        self.dest_fd = dest_fd
        self.peer_timeout = peer_timeout
        self.dead: set[int] = set()
        self._out: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._held: dict[int, trio.Event] = {}  # seq -> set when the partner holds it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # The MPI thread's (then finish's): the owner's ops not landed, in order.
        self.holding: list[Op] = []
        self._incomplete: dict[int, int] = {}  # put seq -> pieces still to come
        self.owner_heard = time.monotonic()
        self.owner_done = False
        self.owner_landed = 0
        self.sent_bytes = 0

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
        """The lander's hook: a new op, for the partner (in the journal's order)."""
        if self.partner in self.dead or self.partner == self.rank:
            return
        if op.kind == PUT:
            self._held[op.seq] = trio.Event()
        self._out.put(("send", op))

    async def replicate(self, op: Op) -> None:
        """Return once the partner holds the put `op`'s bytes, or once it is taken for dead."""
        held = self._held.get(op.seq)
        if held is None:
            return
        with trio.move_on_after(self.peer_timeout + op.size / (REPLICATE_MB_S * 1e6)):
            await held.wait()
        self._held.pop(op.seq, None)
        if not held.is_set():
            log.warning("rank %d did not confirm a copy of %s: taken for dead, closed files "
                        "are no longer replicated", self.partner, op.describe())  # fmt: skip
            self.dead.add(self.partner)

    def landed(self, seq: int) -> None:
        """The lander's hook: everything up to `seq` is at DEST (the partner may forget)."""
        if self.partner not in self.dead:
            self._out.put(("landed", seq))

    def _confirmed(self, seq: int) -> None:
        event = self._held.get(seq)
        if event is not None:
            event.set()

    async def finish(self, drain_s: float, all_landed: bool, landed: int) -> None:
        """After the unmount: say bye to the partner if everything of ours is at DEST, wait
        for the owner's bye (at most `drain_s`, less if it is dead), then land what the owner
        left."""
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
        if self.holding and not self.owner_done:
            await trio.to_thread.run_sync(self._land_owners)

    # -- the MPI thread --------------------------------------------------------------------

    def _loop(self) -> None:
        sleep = IDLE_SLEEP_S[0]
        last_beat = 0.0
        while not self._stop.is_set():
            busy = False
            try:
                while True:
                    item = self._out.get_nowait()
                    busy = True
                    self._send(item)
            except queue.Empty:
                pass
            if time.monotonic() - last_beat > HEARTBEAT_S:
                last_beat = time.monotonic()
                self._post(("hb",), self.partner)
            busy = self._take_incoming() or busy
            sleep = IDLE_SLEEP_S[0] if busy else min(IDLE_SLEEP_S[1], sleep * 2)
            time.sleep(sleep)
        with contextlib.suppress(queue.Empty):  # a bye queued last
            while True:
                self._send(self._out.get_nowait())

    def _post(self, msg: tuple[Any, ...], dest: int) -> None:
        if dest in self.dead or dest == self.rank:
            return
        try:
            self.world.post(msg, dest, TAG)
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
            while src not in self.dead and self.world.pending(src, TAG):
                took = True
                self._receive(src, self.world.recv(src, TAG))
        return took

    def _send(self, item: tuple[Any, ...]) -> None:
        what = item[0]
        if what == "send":
            op: Op = item[1]
            if op.kind != PUT:
                self._post(("op", op.seq, op.kind, op.path, op.new), self.partner)
                return
            fd = self._open_local(op.ino)
            if fd is None:  # unlinked before it could be sent: nothing to keep
                self._confirm_from_thread(op.seq)
                return
            try:
                size = os.fstat(fd).st_size
                parts = max(1, -(-size // PIECE))
                for i in range(parts):
                    data = os.pread(fd, PIECE, i * PIECE)
                    self._post(("put", op.seq, op.path, op.mode, i, parts, data), self.partner)
                    self.sent_bytes += len(data)
            finally:
                os.close(fd)
        elif what == "landed":
            self._post(("landed", item[1]), self.partner)
        elif what == "bye":
            self._post(("bye", item[1]), self.partner)

    def _confirm_from_thread(self, seq: int) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._confirmed, seq, trio_token=self._token)

    def _receive(self, src: int, msg: Any) -> None:
        if not isinstance(msg, tuple) or not msg or not isinstance(msg[0], str):
            log.warning("rank %d sent a malformed message: ignored", src)
            return
        kind = msg[0]
        if src == self.partner and kind == "held" and len(msg) == 2:
            self._confirm_from_thread(int(msg[1]))
        if src != self.owner:
            return
        self.owner_heard = time.monotonic()
        try:
            if kind == "put":
                self._hold_piece(*msg[1:])
            elif kind == "op":
                seq, op_kind, path, new = msg[1:]
                self.holding.append(Op(int(seq), str(op_kind), bytes(path), bytes(new)))
            elif kind == "landed":
                self._forget(int(msg[1]))
            elif kind == "bye":
                self._forget(int(msg[1]))
                self.owner_done = True
        except (TypeError, ValueError, OSError) as e:
            log.warning("rank %d: a copy could not be kept (%s)", src, e)

    def _name(self, seq: int) -> str:
        return f"r{self.owner}-{seq}"

    def _hold_piece(self, seq: int, path: bytes, mode: int, part: int, parts: int,
                    data: bytes) -> None:  # fmt: skip
        seq, part, parts = int(seq), int(part), int(parts)
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if part == 0:
            flags |= os.O_CREAT | os.O_TRUNC
            self.holding.append(Op(seq, PUT, bytes(path), ino=seq, mode=int(mode)))
            self._incomplete[seq] = parts
        fd = os.open(self._name(seq), flags, 0o600, dir_fd=self.staging.fd)
        try:
            os.pwrite(fd, data, part * PIECE)
        finally:
            os.close(fd)
        self._incomplete[seq] -= 1
        if self._incomplete[seq] == 0:
            del self._incomplete[seq]
            self._post(("held", seq), self.owner)

    def _forget(self, seq: int) -> None:
        self.owner_landed = max(self.owner_landed, seq)
        keep = []
        for op in self.holding:
            if op.seq <= seq:
                if op.kind == PUT:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._name(op.seq), dir_fd=self.staging.fd)
            else:
                keep.append(op)
        self.holding = keep

    def _open_copy(self, seq: int) -> int | None:
        if seq in self._incomplete:
            return None  # never closed by its writer: the close waited for all of it
        try:
            return os.open(self._name(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=self.staging.fd)  # fmt: skip
        except FileNotFoundError:
            return None

    def _land_owners(self) -> None:
        log.warning("rank %d left %d changes not at DEST: landing them from the copies here",
                    self.owner, len(self.holding))  # fmt: skip
        while self.holding:
            op = self.holding[0]
            try:
                apply(self.dest_fd, op, self._open_copy)
            except (OSError, LandingError) as e:
                log.error("rank %d's %s %s could not land from here: %s; kept in %s", self.owner,
                          op.kind, op.describe(), e, self.staging.path)  # fmt: skip
                self.staging.keep_contents()
                return
            self._forget(op.seq)

    def statistics(self) -> dict[str, Any]:
        return {"partner": self.partner, "holding_for": self.owner,
                "held_files": sum(1 for op in self.holding if op.kind == PUT),
                "held_changes": len(self.holding), "sent_bytes": self.sent_bytes,
                "dead": sorted(self.dead)}  # fmt: skip
