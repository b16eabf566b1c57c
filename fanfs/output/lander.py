"""The landing journal: every change made under an output mount, applied to DEST in order.

An output mount (`fanfs output`) keeps its files on the node's disk and lands them on DEST, a
directory on the shared file system, in the background. Each change the writer makes is one
`Op` (dest.py) in a journal, in the order it happened: `put` (a closed file's content, under
the path it had when it was closed), `rename`, `unlink`, `mkdir`, `rmdir`. One worker applies
them to DEST strictly in that order (dest.apply), so DEST goes through the same states as the
mount did, at the granularity of closed files.

Failures: an op that fails (DEST unwritable, full, gone) stays at the head of the journal and
is retried with backoff, for ever; nothing behind it is applied out of order, nothing is
dropped. Its error and attempts are in `statistics()` (`fanfs status`), `fanfs sync` and
`fanfs umount` report it and the files still pending, and a later retry (after the fault is
fixed) completes the journal.

Concurrency: the journal lives in the trio thread (`enqueue`, `run`); each op's I/O runs in a
worker thread (`trio.to_thread`), so a slow or hung DEST never blocks the mount's requests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from fanfs.output.dest import PUT, LandingError, Op, apply, remove_marker, write_marker

log = logging.getLogger(__name__)

RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0  # backoff of a failing op: quick at first, then patient


class Lander:
    """The journal of one output mount and the task that lands it on DEST."""

    def __init__(self, dest_fd: int, open_local: Callable[[int], int | None], token: str,
                 max_ops: int = 1 << 20, on_enqueued: Callable[[Op], None] = lambda op: None,
                 on_landed: Callable[[Op], None] = lambda op: None,
                 marker: bool = False):  # fmt: skip
        self.dest_fd = dest_fd
        self._open_local = open_local
        self.max_ops = max_ops  # ops held at most (memory): more fail with ENOSPC
        self.journal: deque[Op] = deque()
        self.enqueued = 0  # seq of the last op enqueued
        self.landed = 0  # every op with seq <= landed is at DEST
        self.pending_bytes = 0
        self.pending_puts = 0
        self.landed_bytes = 0
        self.landed_files = 0
        self.busy_s = 0.0  # time spent landing (throughput = landed_bytes / busy_s)
        self.last_put_s = 0.0  # enqueue to landed, for the last put
        self.token = token
        self.marker = marker  # record progress at DEST after each op (write_marker)
        self.on_enqueued = on_enqueued  # replicas.py hears of each op, in order
        self.on_landed = on_landed  # and of each op landed; the tree frees a put's data
        self._changed = trio.Event()  # something enqueued, landed or failed
        self._poke = trio.Event()  # retry now (a sync or an umount asks)
        self._backoff_from = 0  # attempts of the head op when a retry was last asked for

    def full(self) -> bool:
        return len(self.journal) >= self.max_ops

    def enqueue(self, kind: str, path: bytes, new: bytes = b"", ino: int = 0, mode: int = 0,
                size: int = 0) -> Op:  # fmt: skip
        self.enqueued += 1
        op = Op(self.enqueued, kind, path, new, ino, mode, size)
        self.journal.append(op)
        self.pending_bytes += size
        self.pending_puts += kind == PUT
        self.on_enqueued(op)
        self._wake()
        return op

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def poke(self) -> None:
        """Retry a failing op now instead of after its backoff, and back off from the start
        again (someone thinks DEST works now)."""
        self._backoff_from = self.journal[0].attempts if self.journal else 0
        self._poke.set()

    async def wait_landed(self, seq: int, give_up_after_failures: int = 0) -> None:
        """Until every op up to `seq` is at DEST. LandingError once the op at the head has
        failed `give_up_after_failures` times (0: wait for ever)."""
        while self.landed < seq:
            head = self.journal[0] if self.journal else None
            if give_up_after_failures and head is not None and \
                    head.attempts >= give_up_after_failures:  # fmt: skip
                raise LandingError(f"{head.describe()}: {head.error}")
            await self._changed.wait()

    async def run(self) -> None:
        """Land the journal, in order, for ever (cancelled by the daemon at the end)."""
        if self.marker:  # from the start: a missing marker means "unknown", not "nothing"
            with contextlib.suppress(OSError):
                await trio.to_thread.run_sync(write_marker, self.dest_fd, self.token, 0)
        while True:
            while not self.journal:
                await self._changed.wait()
            op = self.journal[0]
            began = time.monotonic()
            try:
                n = await trio.to_thread.run_sync(self._apply, op, abandon_on_cancel=True)
            except (OSError, LandingError) as e:
                op.failed(os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e))
                log.warning("%s %s at DEST failed (attempt %d): %s", op.kind, op.describe(),
                            op.attempts, op.error)  # fmt: skip
                self._wake()
                self._poke = trio.Event()
                tries = max(0, op.attempts - self._backoff_from - 1)
                with trio.move_on_after(min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(tries, 16))):
                    await self._poke.wait()
                continue
            self.busy_s += time.monotonic() - began
            self.journal.popleft()
            self.pending_bytes -= op.size
            self.pending_puts -= op.kind == PUT
            self.landed = op.seq
            if op.kind == PUT and n:
                self.landed_bytes += n
            if op.kind == PUT:
                self.landed_files += 1
                self.last_put_s = time.monotonic() - op.queued
            if op.attempts:
                log.info("%s %s landed after %d failed attempts", op.kind, op.describe(),
                         op.attempts)  # fmt: skip
            self.on_landed(op)
            self._wake()

    def _apply(self, op: Op) -> int:
        n = apply(self.dest_fd, op, self._open_local, self.token)
        if self.marker:
            write_marker(self.dest_fd, self.token, op.seq)
        return n

    def forget_marker(self) -> None:
        """Remove this daemon's marker from DEST (its partner, which would, is gone)."""
        if self.marker:
            remove_marker(self.dest_fd, self.token)

    def pending_files(self, most: int | None = None) -> list[str]:
        """The paths of the puts not at DEST yet, oldest first (each once; at most `most`,
        looking no further than needed: the status asks ten times a second during a sync)."""
        seen: dict[str, None] = {}
        for op in self.journal:
            if op.kind == PUT:
                seen.setdefault(os.fsdecode(op.path), None)
                if most is not None and len(seen) >= most:
                    break
        return list(seen)

    def statistics(self) -> dict[str, Any]:
        head = self.journal[0] if self.journal else None
        now = time.monotonic()
        return {
            "enqueued": self.enqueued,
            "landed": self.landed,
            "backlog_ops": len(self.journal),
            "backlog_files": self.pending_puts,
            "backlog_bytes": self.pending_bytes,
            "oldest_s": round(now - head.queued, 3) if head is not None else 0.0,
            "landed_files": self.landed_files,
            "landed_bytes": self.landed_bytes,
            "throughput_mb_s": round(self.landed_bytes / self.busy_s / 1e6, 1)
            if self.busy_s > 0 else 0.0,
            "last_put_s": round(self.last_put_s, 3),
            "failing": None if head is None or not head.attempts else {
                "op": head.kind, "path": head.describe(), "attempts": head.attempts,
                "error": head.error,
            },
            "pending": self.pending_files(20),
        }  # fmt: skip
