"""The landing journal: every change DEST must see, in order, coalesced, and kept on the node.

Each change made under an output mount is one `Op`: `put` (a snapshot of a file's bytes: the
first `size` bytes of a local file that nothing changes while the put is pending, tree.py),
`rename`, `unlink`, `mkdir`, `rmdir`, `attr` (a mode or an mtime). The lander applies them to
DEST strictly in the journal's order, one at a time, but for what coalescing changes:

- A newer snapshot of a file whose put is still pending (and not being applied) takes that
  put's place: DEST never sees the older version, and the file lands where the older one
  would have, in the order. `keep`, the leading bytes that did not change since the file's
  previous put, is the smaller of the two, so an append still lands as one.
- A file removed from the mount (its last name unlinked, or replaced by a rename) loses its
  pending puts: a version nobody can see any more is never landed (a checkpoint rotated before
  it landed costs DEST nothing). One being applied then is orphaned: it goes if that attempt
  fails (lander.py), so a checkpoint replaced while DEST failed never lands once it is back.
- A put that was not landed (`drop`: a conditional put that would have replaced what is not
  ours, or the user's `fanfs sync --skip`) hands its older bytes' `keep` to the next put of
  the same file, which then knows less is unchanged.

So: a change lands only after every change made before it, each file of those in the version
it had then or a later one, or removed if it was removed since (docs/commands.md states it).

Persistence: every record is appended to `journal` in the staging directory as one JSON
line, with no fsync: it is there for the daemon's death (SIGKILL, OOM), which leaves the page
cache, not for the node's (which takes the node's disk with it). recover.py replays it:
- {"op": ...} an op, as `Op.record`; {"merge": seq, ...} a newer snapshot in its place;
  {"drop": seq}, {"skip": seq}: it will not land; {"landed": seq, "node", "ident"}: it did,
  and what DEST holds for the node now;
- {"name": path, "node", "data"}: a file's local data (at its creation, and when it moves to
  new data); {"writing": node}, {"written": node}: its first handle for writing opened, its
  last one closed (what is being written when the daemon dies is kept, named);
- a rewritten (compacted) file: the header, {"file": node, "path", "data", "writing",
  "ident"} for each file and directory, {"skipped": ...}, then the pending ops marked
  "compacted" (their names are already where those ops leave them).
The file is rewritten short when nothing is pending and it has grown, and at once after a
record could not be written (Log: it is emptied then, never left with a hole).

Concurrency: the trio thread only. Records are a few hundred bytes, written inline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PUT, RENAME, UNLINK, MKDIR, RMDIR, ATTR = "put", "rename", "unlink", "mkdir", "rmdir", "attr"
KINDS = (PUT, RENAME, UNLINK, MKDIR, RMDIR, ATTR)
NAME = "journal"
VERSION = 1
COMPACT_BYTES = 4 << 20  # rewrite an idle journal past this (and past 512 bytes per file)
COMPACT_RETRY_S = 5.0  # a broken journal is rewritten at most this often


@dataclass(slots=True)
class Op:
    """One change to apply to DEST. Paths are relative to DEST, bytes, components separated
    by b"/". `node` is the mount's inode the change is about (puts, and renames, removals and
    attrs of what the daemon landed itself: dest.py checks it is still what it landed)."""

    seq: int
    kind: str
    path: bytes
    new: bytes = b""
    node: int = 0
    data: int = 0  # a put's local file, o<data>
    size: int = 0  # a put lands the first `size` bytes of it
    keep: int = 0  # leading bytes unchanged since the node's previous put (appends land as such)
    mode: int = -1  # put, mkdir, attr: permission bits (-1: unchanged)
    mtime_ns: int = -1  # put, attr: the modification time to give it (-1: unchanged)
    cond: bool = False  # land only as a new file or an append to our own (open files' puts)
    replaced: int = 0  # a rename: the node it replaced (DEST forgets what it landed for it)
    queued: float = field(default_factory=time.monotonic)
    attempts: int = 0
    error: str = ""
    busy: bool = False  # being applied: no longer merged into, nor dropped
    orphaned: bool = False  # its node lost its name while it was applied: goes if that fails
    gone: bool = False  # dropped: left in the deque until it reaches the head (O(1) removal)

    # An op changes through these (the journal and the lander call them).
    def failed(self, error: str) -> None:
        self.attempts += 1
        self.error = error

    def start(self) -> None:
        self.busy = True

    def stop(self) -> None:
        self.busy = False

    def drop(self) -> None:
        self.gone = True

    def orphan(self) -> None:
        """Its node lost its name while it was being applied (it could not be dropped then)."""
        self.orphaned = True

    def narrow(self, keep: int) -> None:
        """Fewer leading bytes are known unchanged (the put before it did not land)."""
        self.keep = min(self.keep, keep)

    def take(self, data: int, size: int, keep: int, mode: int, mtime_ns: int, cond: bool) -> None:
        """A newer snapshot of the same file, in this put's place."""
        self.data, self.size, self.keep = data, size, min(self.keep, keep)
        self.mode, self.mtime_ns, self.cond = mode, mtime_ns, self.cond and cond

    def grew(self, size: int) -> None:
        self.size = max(self.size, size)

    def describe(self) -> str:
        path = os.fsdecode(self.path)
        return f"{path} -> {os.fsdecode(self.new)}" if self.kind == RENAME else path

    def record(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "path": os.fsdecode(self.path),
                "new": os.fsdecode(self.new), "node": self.node, "data": self.data,
                "size": self.size, "keep": self.keep, "mode": self.mode,
                "mtime_ns": self.mtime_ns, "cond": self.cond,
                "replaced": self.replaced}  # fmt: skip

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> Op:
        """An op from its record (recover.py); ValueError if it is not one."""
        try:
            op = cls(int(r["seq"]), str(r["kind"]), os.fsencode(r["path"]), os.fsencode(r["new"]),
                     int(r["node"]), int(r["data"]), int(r["size"]), int(r["keep"]),
                     int(r["mode"]), int(r["mtime_ns"]), bool(r["cond"]),
                     int(r["replaced"]))  # fmt: skip
        except (KeyError, TypeError) as e:
            raise ValueError(f"not an op: {e}") from None
        if op.kind not in KINDS or op.size < 0 or op.data < 0 or b"\0" in op.path + op.new:
            raise ValueError(f"not an op: {r!r}")
        return op


class Log:
    """The journal's file: JSON lines appended to `journal` in a staging directory.

    A record that cannot be written (the node's disk full, say) breaks the file: it is
    emptied at once (a replay of a file missing a record would land the wrong things; an
    empty one is not replayed at all) and written again whole at the next compaction."""

    def __init__(self, dir_fd: int, header: dict[str, Any]):
        self.dir_fd = dir_fd
        self.header = {"fanfs_journal": VERSION, **header}
        self.fd = -1
        self.bytes = 0
        self.broken = False
        self._tried = 0.0
        self._open(self.header, [])

    def _open(self, header: dict[str, Any], records: list[dict[str, Any]]) -> None:
        """(Re)write the file: the header, then `records`; atomically (a rename)."""
        tmp = f"{NAME}.new"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self.dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # recover.py: held while alive
            text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in [header, *records])
            data = text.encode()
            done = 0
            while done < len(data):  # all of it, or not in place: a short file loses records
                done += os.write(fd, data[done:])
            os.rename(tmp, NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir_fd)
            raise
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.bytes, self.broken = fd, len(data), False

    def write(self, record: dict[str, Any]) -> None:
        if self.broken:
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            if os.write(self.fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            log.error(
                "the journal in the staging directory cannot be written (%s): until it "
                "can, a daemon killed with SIGKILL leaves its files unnamed",
                e.strerror,
            )
            self.broken = True
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            return
        self.bytes += len(line)

    def compact(self, records: list[dict[str, Any]]) -> None:
        self._tried = time.monotonic()
        try:
            self._open(self.header, records)
        except OSError as e:
            log.warning("the journal could not be rewritten: %s", e.strerror)

    def may_compact(self) -> bool:
        """Not more than every few seconds while it fails (a full disk)."""
        return time.monotonic() - self._tried > COMPACT_RETRY_S

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read(fd: int) -> tuple[list[dict[str, Any]], int]:
    """The records of a journal file (recover.py), and the length of the lines they came
    from: a torn last line (the daemon died while writing it) ends them."""
    data = b""
    while chunk := os.read(fd, 1 << 20):
        data += chunk
    records, good = [], 0
    for line in data.split(b"\n")[:-1]:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not isinstance(record, dict):
            break
        records.append(record)
        good += len(line) + 1
    return records, good


class Journal:
    """The ops not landed yet, in order, with the coalescing above and their records."""

    def __init__(self, log: Log | None, max_ops: int = 1 << 20,
                 on_enqueued: Callable[[Op], None] | None = None):  # fmt: skip
        self.log = log
        self.max_ops = max_ops  # ops held at most (memory): more fail with ENOSPC
        self.ops: deque[Op] = deque()
        self._puts: dict[int, list[Op]] = {}  # node -> its pending puts, in order
        self.enqueued = 0  # seq of the last op enqueued
        self.pending_bytes = 0
        self.pending_puts = 0
        self.merged = 0  # puts that took a newer snapshot instead of a second put
        self.dropped = 0  # puts never landed: their file was removed, or they were skipped
        self.on_enqueued = on_enqueued or (lambda op: None)  # replicas.py: each op, in order
        # With a partner, the copies of merged snapshots it holds count against max_ops too
        # (it bounds what it holds by the same number): their seqs, until they land.
        self._copies: deque[int] | None = deque() if on_enqueued is not None else None

    def full(self) -> bool:
        copies = 0
        if self._copies is not None:
            landed = self.landed_seq()
            while self._copies and self._copies[0] <= landed:
                self._copies.popleft()
            copies = len(self._copies)
        return len(self.ops) + copies >= self.max_ops

    def landed_seq(self) -> int:
        """Every op with a seq up to this is at DEST (or was dropped)."""
        head = self.head()
        return head.seq - 1 if head is not None else self.enqueued

    def _record(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(record)

    def add(self, kind: str, path: bytes, **fields: Any) -> Op:
        self.enqueued += 1
        op = Op(self.enqueued, kind, path, **fields)
        self.ops.append(op)
        if kind == PUT:
            self._puts.setdefault(op.node, []).append(op)
            self.pending_bytes += op.size
            self.pending_puts += 1
        self._record({"op": op.record()})
        self.on_enqueued(dataclasses.replace(op))  # a copy: the journal's own changes later
        return op

    def put(self, node: int, path: bytes, data: int, size: int, keep: int, mode: int,
            mtime_ns: int, cond: bool = False) -> tuple[Op, Op | None, int]:  # fmt: skip
        """A snapshot of `node`: (its put, None, the seq the partner knows it by) or, merged
        into a pending put, (that put, what it held before: the caller releases that data,
        the seq of the partner's copy)."""
        pending = self._puts.get(node)
        last = pending[-1] if pending else None
        if last is None or last.busy:
            op = self.add(PUT, path, node=node, data=data, size=size, keep=keep, mode=mode,
                          mtime_ns=mtime_ns, cond=cond)  # fmt: skip
            return op, None, op.seq
        old = Op(last.seq, PUT, last.path, data=last.data, size=last.size)
        self.pending_bytes += size - last.size
        last.take(data, size, keep, mode, mtime_ns, cond)
        self.merged += 1
        self._record({"merge": last.seq, "data": data, "size": size, "keep": last.keep,
                      "mode": mode, "mtime_ns": mtime_ns, "cond": last.cond})  # fmt: skip
        # The partner (replicas.py) gets the new snapshot as an op of its own, after those
        # it has: replayed in order, its copies land every version, which is safe.
        self.enqueued += 1
        if self._copies is not None:
            self._copies.append(self.enqueued)
        self.on_enqueued(Op(self.enqueued, PUT, path, node=node, data=data, size=size,
                            mode=mode, mtime_ns=mtime_ns))  # fmt: skip
        return last, old, self.enqueued

    def last_put(self, node: int) -> Op | None:
        pending = self._puts.get(node)
        return pending[-1] if pending else None

    def remove_node(self, node: int) -> list[Op]:
        """`node` has no name any more: its pending puts that are not being applied go; one
        being applied is orphaned (the lander drops it if that attempt fails)."""
        pending = self._puts.get(node, [])
        for op in pending:
            if op.busy:
                op.orphan()
        gone = [op for op in pending if not op.busy]
        for op in gone:
            self._forget(op)
            self._record({"drop": op.seq})
        return gone

    def _forget(self, op: Op) -> None:
        op.drop()
        self._forget_put(op)
        self.dropped += op.kind == PUT

    def _forget_put(self, op: Op) -> None:
        if op.kind != PUT:
            return
        self.pending_bytes -= op.size
        self.pending_puts -= 1
        pending = self._puts.get(op.node, [])
        with contextlib.suppress(ValueError):
            pending.remove(op)
        if not pending:
            self._puts.pop(op.node, None)

    def drop(self, op: Op, record: str = "drop") -> None:
        """A put that will not land (a conditional one that would have replaced what is not
        ours; a skipped one): the next put of its node keeps no more than it did."""
        self._forget(op)
        for later in self._puts.get(op.node, ()):
            later.narrow(op.keep)
            break
        self._record({record: op.seq})

    def head(self) -> Op | None:
        while self.ops and self.ops[0].gone:
            self.ops.popleft()
        return self.ops[0] if self.ops else None

    def pending(self) -> Iterator[Op]:
        return (op for op in self.ops if not op.gone)

    def landed(self, op: Op, ident: list[int] | None) -> None:
        """`op`, the head, is at DEST; `ident` is what dest.py saw of it there."""
        assert self.head() is op
        self.ops.popleft()
        self._forget_put(op)
        self._record({"landed": op.seq, "node": op.node, "ident": ident})

    def note(self, record: dict[str, Any]) -> None:
        """A record for recover.py only: a file's name and data, whether it changed."""
        self._record(record)

    def compact(self, files: Callable[[], list[dict[str, Any]]]) -> None:
        """Rewrite the file short: when nothing is pending and it has grown, or at once when
        it is broken (`files`: what recover.py needs of the files that exist now)."""
        if self.log is None or not self.log.may_compact():
            return
        if not self.log.broken and (self.head() is not None or self.log.bytes < COMPACT_BYTES):
            return
        # The files' records hold their names as they are now: the pending ops after them
        # are not replayed as moves again.
        now = files() + [{"op": op.record(), "compacted": True} for op in self.pending()]
        if self.log.broken or self.log.bytes > max(COMPACT_BYTES, 512 * len(now)):
            self.log.compact(now)

    def pending_files(self, most: int | None = None) -> list[str]:
        """The paths of the puts not at DEST yet, oldest first (each once; at most `most`,
        looking no further than needed: the status asks ten times a second during a sync)."""
        seen: dict[str, None] = {}
        for op in self.pending():
            if op.kind == PUT:
                seen.setdefault(os.fsdecode(op.path), None)
                if most is not None and len(seen) >= most:
                    break
        return list(seen)
