"""The lander: the journal (journal.py) applied to DEST (dest.py), in order, one op at a time.

First what dead daemons left for this DEST (recover.py: their journals, in the order they
ran), then this mount's own journal. Each op's I/O runs in a worker thread, so a slow or hung
DEST never blocks the mount's requests.

Failures: an op that fails (DEST unwritable, full, gone, replaced) stays at the head and is
retried with backoff, for as long as the daemon runs; nothing behind it lands out of order.
The user can get past it without losing anything: a newer version of the file (or its
removal) supersedes it (journal.py; a put whose file was removed or replaced during its attempt,
orphaned, goes when that attempt fails), and `fanfs sync --skip` skips it (`skip`): its bytes stay
on the node, named (view.py keeps them), and the rest lands. Its error and attempts are in
`statistics()` (`fanfs status`); `sync` and `umount` report it.

What fanfs landed: `idents` maps each node (the mount's inode) to what is at DEST for it
(dest.Ident), so renames and removals touch only that, and a file that grew is appended to.

Concurrency: the trio thread (`run`, and the hooks it calls); `apply` (apply.py) in worker threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from fanfs.output import dest as dst
from fanfs.output.apply import apply, remove_partial
from fanfs.output.dest import Dest, Ident, LandingError, Outcome, Result
from fanfs.output.journal import ATTR, MKDIR, PUT, RENAME, RMDIR, UNLINK, Journal, Op

log = logging.getLogger(__name__)

RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0  # backoff of a failing op: quick at first, then patient
NAMING = (PUT, RENAME, UNLINK, MKDIR, RMDIR)  # ops that may add or remove a name at DEST


@dataclass(slots=True)
class Source:
    """Where ops come from: this mount's journal, or a dead daemon's (recover.py)."""

    name: str  # for messages
    token: str  # its name in DEST's temporary names
    open_local: Callable[[int], int | None]
    record: Callable[[dict[str, Any]], None]  # its journal file's record of a landing
    idents: dict[int, Ident] = field(default_factory=dict)
    strict: bool = True


def _message(e: Exception) -> str:
    """What an op's failure says (status, sync, the log)."""
    return os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)


def track(idents: dict[int, Ident], op: Op, ident: Ident | None, landed: bool) -> None:
    """What fanfs has at DEST for each node, after `op` landed (`ident`: what DEST showed of
    it; `landed`: it changed DEST); recover.py replays it from the journal's records."""
    if ident is not None:
        idents[op.node] = ident
    if op.kind in (UNLINK, RMDIR) and landed:
        idents.pop(op.node, None)
    if op.kind == RENAME and op.replaced:
        idents.pop(op.replaced, None)


class Lander:
    """Lands `journal` (and `recovering` first) on `dest`, for ever (cancelled at the end)."""

    def __init__(self, dest: Dest, journal: Journal, own: Source, *,
                 recovering: list[Any] | None = None, marker: bool = False,
                 on_landed: Callable[[Op, Result], None] = lambda op, r: None,
                 on_dropped: Callable[[Op], None] = lambda op: None,
                 on_skipped: Callable[[Op], None] = lambda op: None,
                 dir_time: Callable[[bytes], tuple[int, int] | None] = lambda p: None,
                 ):  # fmt: skip
        self.dest = dest
        self.journal = journal
        self.own = own
        self.recovering: list[Any] = recovering or []  # recover.Dead, landed first
        self.marker = marker  # record progress at DEST after each op (replicas.py)
        self.on_landed = on_landed  # view.py: release the put's data, evict what may go
        self.on_dropped = on_dropped  # a put that will not land: its node is dirty again
        self.on_skipped = on_skipped  # the user skipped it: view.py keeps its bytes
        self.dir_time = dir_time  # view.py: the time a directory must show again (`_retime`)
        self.landed_bytes = 0  # bytes written to DEST
        self.landed_files = 0
        self.appended = 0  # puts that landed as appends
        self.skipped: list[Op] = []
        self.busy_s = 0.0  # time spent landing (throughput = landed_bytes / busy_s)
        self.last_put_s = 0.0  # enqueue to landed, for the last put
        self.current: Op | None = None  # the op being applied or retried
        self._changed = trio.Event()  # something enqueued, landed or failed
        self._poke = trio.Event()  # retry now (a sync or an umount asks)
        self._skip: Op | None = None  # the op the user asked to skip (failing when asked)
        self._backoff_from = 0  # attempts of the failing op when a retry was last asked for
        # Puts given up after a failed attempt, whose partial file DEST may still hold (it
        # refused its removal too): removed once DEST takes something again.
        self._litter: list[tuple[bytes, str, int]] = []

    @property
    def idents(self) -> dict[int, Ident]:
        return self.own.idents

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def poke(self) -> None:
        """Retry a failing op now instead of after its backoff, and back off from the start
        again (someone thinks DEST works now)."""
        self._backoff_from = self.current.attempts if self.current else 0
        self._poke.set()

    def skip(self, seq: int) -> str | None:
        """Skip op `seq` if it is the one failing now (`fanfs sync --skip`): what it is; the
        same again if it was skipped already (a reader of the answer may ask twice); None if
        it is not failing."""
        for op in (self.current, self._skip, *self.skipped[-8:]):
            if op is not None and op.seq == seq and (op.attempts or op is not self.current):
                if op is self.current:
                    self._skip = op
                    self._poke.set()
                return f"{op.kind} {op.describe()}"
        return None

    def idle(self) -> bool:
        return not self.recovering and self.journal.head() is None

    async def wait_landed(self, seq: int, give_up_after_failures: int = 0) -> None:
        """Until every op up to `seq` is at DEST (and what dead daemons left). LandingError
        once an op has failed `give_up_after_failures` more times since this was called (0:
        wait for ever)."""
        first = self.current
        before = first.attempts if first is not None else 0
        while self.recovering or self.journal.landed_seq() < seq:
            op = self.current
            if give_up_after_failures and op is not None:
                failed = op.attempts - (before if op is first else 0)
                if failed >= give_up_after_failures:
                    raise LandingError(f"{op.describe()}: {op.error}")
            await self._changed.wait()

    async def run(self) -> None:
        if self.marker:  # from the start: a missing marker means "unknown", not "nothing"
            await self._io(dst.write_marker, self.dest, self.own.token, 0)
        while self.recovering:
            dead = self.recovering[0]
            await self._recover(dead)
            self.recovering.pop(0)
            self.wake()
        while True:
            op = self.journal.head()
            if op is None:
                await self._changed.wait()
                continue
            result = await self._land(op, self.own)
            if result is not None:
                self.journal.landed(op, self._ident_json(op))
                if self.marker:
                    await self._io(dst.write_marker, self.dest, self.own.token, op.seq)
                if op.kind in NAMING:  # landed, or nothing to do there: the time is the mount's
                    await self._retime(op.path, op.new)
                self.on_landed(op, result)
                if self._litter:
                    await self._sweep()
            self.wake()

    async def _io(self, fn: Callable[..., Any], *args: Any) -> None:
        """A DEST call whose failure only costs a message (the marker)."""
        try:
            await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except (OSError, LandingError) as e:
            log.warning("DEST %s: %s", self.dest.path, e)

    async def _sweep(self) -> None:
        litter, self._litter = self._litter, []
        for path, token, seq in litter:
            try:
                await trio.to_thread.run_sync(remove_partial, self.dest, path, token, seq,
                                              abandon_on_cancel=True)  # fmt: skip
            except (OSError, LandingError):
                self._litter.append((path, token, seq))
            else:
                await self._retime(path)

    async def _retime(self, *paths: bytes) -> None:
        """A name was added or removed at DEST in the directories of `paths` (a rename's two):
        each whose time the user set in the mount gets that time back, as an `attr` would
        (only on the directory fanfs made there). A failure costs a message, never a retry."""
        for path in {os.path.dirname(p) for p in paths if p}:
            at = self.dir_time(path)
            if at is None:
                continue
            node, mtime_ns = at
            op = Op(0, ATTR, path, node=node, mtime_ns=mtime_ns)
            try:
                result = await trio.to_thread.run_sync(
                    apply, self.dest, op, self.own.open_local, self.own.token,
                    self.idents.get(node), abandon_on_cancel=True)  # fmt: skip
            except (OSError, LandingError) as e:
                log.warning("DEST %s: the time of %s: %s", self.dest.path, op.describe(),
                            _message(e))  # fmt: skip
                continue
            track(self.idents, op, result.ident, landed=False)

    def _ident_json(self, op: Op) -> list[int] | None:
        ident = self.own.idents.get(op.node)
        return ident.to_json() if ident is not None and op.kind != RENAME else None

    async def _recover(self, dead: Any) -> None:
        try:
            await trio.to_thread.run_sync(dead.skip_landed_by_partner, self.dest,
                                          abandon_on_cancel=True)  # fmt: skip
        except (OSError, LandingError) as e:  # then all are replayed, which is safe (dest.py)
            log.warning("%s: the replicas' marker at DEST cannot be read: %s", dead.path, e)
        log.warning("landing what a dead daemon left (%s): %d changes", dead.source.name,
                    len(dead.pending))  # fmt: skip
        while dead.pending:
            op = dead.pending[0]
            if await self._land(op, dead.source) is not None:
                ident = dead.source.idents.get(op.node)
                dead.source.record({"landed": op.seq, "node": op.node,
                                    "ident": ident.to_json() if ident else None})  # fmt: skip
            elif op in self.skipped:
                dead.skipped.append(op)  # its bytes stay there, named
            dead.pending.pop(0)
            self.wake()
        try:
            await trio.to_thread.run_sync(dead.finish, self.dest, abandon_on_cancel=True)
        except OSError as e:
            log.warning("%s: not cleaned up: %s", dead.path, e.strerror)

    async def _land(self, op: Op, source: Source) -> Result | None:
        """Apply `op` until it lands (what it did), or is dropped or skipped (None)."""
        self.current = op
        try:
            while True:
                if op.gone:
                    self._skip = None if self._skip is op else self._skip
                    return None
                if self._skip is op:
                    self._skip = None
                    self._skipped(op, source)
                    return None
                self._poke = trio.Event()  # a poke from now on retries this op at once
                op.start()
                began = time.monotonic()
                expect = source.idents.get(op.node)
                replaced = source.idents.get(op.replaced) if op.replaced else None
                try:
                    result = await trio.to_thread.run_sync(
                        apply, self.dest, op, source.open_local, source.token, expect,
                        source.strict, replaced, abandon_on_cancel=True,
                    )  # fmt: skip
                except (OSError, LandingError) as e:
                    op.stop()
                    if op.orphaned and source is self.own:
                        self._orphan_failed(op, e)
                        return None
                    await self._failed(op, e)
                    continue
                op.stop()
                self.busy_s += time.monotonic() - began
                return result if self._applied(op, result, source) else None
        finally:
            self.current = None
            if self._skip is op:  # it landed, or went, before the skip was seen
                self._skip = None
            if op.kind == PUT and op.attempts and (op.gone or op in self.skipped):
                self._litter.append((op.path, source.token, op.seq))

    def _applied(self, op: Op, result: Result, source: Source) -> bool:
        if op.attempts:
            log.info("%s %s landed after %d failed attempts", op.kind, op.describe(),
                     op.attempts)  # fmt: skip
        if result.outcome is Outcome.COND:
            if source is self.own:
                self.journal.drop(op)
                self.on_dropped(op)
            return False
        track(source.idents, op, result.ident, result.outcome is Outcome.LANDED)
        if op.kind == PUT and result.outcome is Outcome.LANDED:
            self.landed_files += 1
            self.landed_bytes += result.sent
            self.appended += result.appended
            self.last_put_s = time.monotonic() - op.queued
        return True

    def _skipped(self, op: Op, source: Source) -> None:
        log.warning("%s %s skipped (fanfs sync --skip): %s", op.kind, op.describe(), op.error)
        self.skipped.append(op)
        if source is self.own:
            self.journal.drop(op, record="skip")
            self.on_skipped(op)
        else:
            source.record({"skip": op.seq})

    def _orphan_failed(self, op: Op, e: Exception) -> None:
        """A put whose file was removed or replaced while this attempt was failing: it goes
        now, as it would have gone then had it not been busy (journal.remove_node), instead of
        landing a superseded version once DEST is back. Counted as an attempt first, so that
        `_land` clears what it may have left at DEST (its partial file)."""
        op.failed(_message(e))
        log.warning("%s %s at DEST failed (%s); its file was removed or replaced meanwhile: "
                    "it will not land", op.kind, op.describe(), op.error)  # fmt: skip
        self.journal.drop(op)
        self.on_dropped(op)

    async def _failed(self, op: Op, e: Exception) -> None:
        op.failed(_message(e))
        log.warning("%s %s at DEST failed (attempt %d): %s", op.kind, op.describe(),
                    op.attempts, op.error)  # fmt: skip
        self.wake()
        tries = max(0, op.attempts - self._backoff_from - 1)
        with trio.move_on_after(min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(tries, 16))):
            await self._poke.wait()

    def forget_marker(self) -> None:
        """Remove this daemon's marker from DEST (its partner, which would, is gone)."""
        if self.marker:
            dst.remove_marker(self.dest, self.own.token)

    def statistics(self) -> dict[str, Any]:
        j = self.journal
        head = self.current or j.head()
        now = time.monotonic()
        return {
            "enqueued": j.enqueued,
            "landed": j.landed_seq(),
            "backlog_ops": sum(1 for _ in j.pending()) if len(j.ops) < 4096 else len(j.ops),
            "backlog_files": j.pending_puts,
            "backlog_bytes": j.pending_bytes,
            "oldest_s": round(now - head.queued, 3) if head is not None else 0.0,
            "landed_files": self.landed_files,
            "landed_bytes": self.landed_bytes,
            "appended_files": self.appended,
            "merged_puts": j.merged,
            "dropped_puts": j.dropped,
            "recovering": sum(len(d.pending) for d in self.recovering),
            "throughput_mb_s": round(self.landed_bytes / self.busy_s / 1e6, 1)
            if self.busy_s > 0 else 0.0,
            "last_put_s": round(self.last_put_s, 3),
            "failing": None if head is None or not head.attempts else {
                "op": head.kind, "path": head.describe(), "attempts": head.attempts,
                "error": head.error, "seq": head.seq,
            },
            "skipped": [os.fsdecode(op.path) for op in self.skipped[:20]],
            "pending": j.pending_files(20),
        }  # fmt: skip
