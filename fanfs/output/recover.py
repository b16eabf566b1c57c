"""What a dead output daemon left on the node, found and landed: its journal replayed.

A daemon killed with SIGKILL (the OOM killer, a job's end past Slurm's KillWait) leaves its
staging directory: the local files and `journal` (journal.py), which says which changes had
not landed, which local file holds each pending put's bytes, what fanfs had landed for each
file (so renames and removals touch only that), and the names of files still being written.
The next `fanfs output` with the same DEST and `--local`, `fanfs output --recover DEST`, or
`fanfs umount` of the dead mount finds it and lands what was closed, in its order, before
anything new (lander.py), with the dead daemon's token: a put it was applying when it died
is applied again, which replaces its orphaned `.partial` file at DEST.

With `--replicas 2`, the dead daemon's partner may have landed some of it already: ops up
to the partner-visible marker at DEST are skipped; without a marker all are replayed, which
is safe because renames and removals touch only what fanfs landed (dest.py).

Before that, the WRITEs its front had answered and not yet written (output/front.py,
`kept_places`) are written into their local files, in the order they were answered: a log's
last line written before the kill is in what stays.

What is then left is only what was never closed: files being written when the daemon died,
and puts the user skipped. They stay in the directory, named in `kept.json` ({DEST path:
local file}); everything else there goes, and the directory with it when it is empty.

Safety: only directories of this user, under a checked `--local`, opened without following
symlinks; a journal is taken only under an exclusive flock, which a live daemon holds on its
own: a directory in use is never touched, and two recoverers never land the same one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fanfs.native import lib
from fanfs.node.staging import PREFIX
from fanfs.output import dest as dst
from fanfs.output.apply import remove_partial
from fanfs.output.dest import Dest, Ident
from fanfs.output.front import KEPT_WRITES, kept_places, open_kept
from fanfs.output.journal import NAME, PUT, RENAME, UNLINK, Op, read
from fanfs.output.lander import Source, track

log = logging.getLogger(__name__)

KEPT = "kept.json"

# The buffers' file's layout: struct fanfs_wb_head and struct fanfs_wb_rec (fanfs/csrc/front.h).
_MAGIC = lib.WB_MAGIC
_HEAD = struct.Struct("=16sIIQ32x")  # magic, buffers, where the first begins, stride
_REC = struct.Struct("=QQQQII24x")  # seq (0: none), dev, ino, off, len, at
_AT = lib.WB_HEAD  # the records fit below it


def write_kept(dir_fd: int, name: str, at: int | None) -> int | None:
    """The WRITEs a killed daemon's front answered and had not written (in `name`, relative
    to `at`), written into its local files (`o<data>` in `dir_fd`, found by device and inode)
    in the order they were answered: how many; None if they could not all be (a file that is
    not one, or not this user's alone, is left whole and nothing is written from it; a write
    that fails leaves it too), said in the log. 0 if there is none."""
    fd = -1
    try:
        fd, st = open_kept(name, at)
        pending = _read_kept(fd, st)
        files = {(st.st_dev, st.st_ino): local for local, st in _locals(dir_fd)}
        for (_seq, dev, ino, off, _n, _skip), data in pending:
            target = files.get((dev, ino))
            if target is None:
                continue  # its file is gone: nothing to keep the bytes in
            try:
                out = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            try:
                os.pwrite(out, data, off)
            finally:
                os.close(out)
        return len(pending)
    except FileNotFoundError:
        return 0  # none: its front never ran
    except (OSError, ValueError, OverflowError, struct.error) as e:
        log.warning("%s: the writes it answered cannot be read back or written (%s): the file "
                    "is left as it is", name, e)  # fmt: skip
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def _read_kept(fd: int, st: os.stat_result) -> list[tuple[tuple[int, ...], bytes]]:
    """The pending records of the buffers' file open at `fd` (`st` its stat), in order, each
    with its bytes, every one checked before any is written; ValueError if it is not one."""
    head = os.pread(fd, _HEAD.size, 0)
    if not head.strip(b"\0"):
        return []  # never set up: its daemon was killed before the front started
    magic, nbufs, at, stride = _HEAD.unpack(head)
    if magic.rstrip(b"\0") != _MAGIC or at != _AT or _HEAD.size + nbufs * _REC.size > at:
        raise ValueError("not one (or of another version)")
    if at + nbufs * stride > st.st_size:
        raise ValueError(f"shorter than its {nbufs} buffers of {stride} bytes")
    recs = os.pread(fd, nbufs * _REC.size, _HEAD.size)
    pending = sorted((r, i) for i, r in enumerate(_REC.iter_unpack(recs)) if r[0] != 0)
    out = []
    for r, i in pending:
        _seq, _dev, _ino, off, n, skip = r
        if skip + n > stride or off + n > 1 << 63:
            raise ValueError(f"a record past its buffer or any file: {r}")
        data = os.pread(fd, n, at + i * stride + skip)
        if len(data) != n:
            raise ValueError(f"a buffer cut short: {len(data)} of {n} bytes")
        out.append((r, data))
    return out


def _locals(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    out = []
    for name in os.listdir(dir_fd):
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if name.startswith("o") and stat.S_ISREG(st.st_mode):
                out.append((name, st))
    return out


@dataclass(slots=True)
class Replay:
    """A journal's records (journal.py says which), replayed: what had not landed, and what
    the node holds."""

    header: dict[str, Any]
    pending: dict[int, Op] = field(default_factory=dict)  # seq -> op, in seq order
    skipped: list[Op] = field(default_factory=list)
    idents: dict[int, Ident] = field(default_factory=dict)
    names: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # node -> path, data
    writing: set[int] = field(default_factory=set)  # nodes open for writing
    dropped: list[Op] = field(default_factory=list)  # puts given up: a partial may be left
    end: int = 0  # bytes of the file replayed (a torn last line is not)

    def take(self, r: dict[str, Any]) -> None:
        if "op" in r:
            op = Op.from_record(r["op"])
            self.pending[op.seq] = op
            if not r.get("compacted"):
                self._moved(op)
        elif "merge" in r:
            merged = self.pending.get(int(r["merge"]))
            if merged is not None:
                merged.take(int(r["data"]), int(r["size"]), int(r["keep"]), int(r["mode"]),
                            int(r["mtime_ns"]), bool(r["cond"]))  # fmt: skip
        elif "drop" in r or "skip" in r:
            gone = self.pending.pop(int(r.get("drop", r.get("skip", 0))), None)
            if gone is not None and "skip" in r:
                self.skipped.append(gone)
            if gone is not None and gone.kind == PUT:
                self.dropped.append(gone)
        elif "landed" in r:
            landed = self.pending.pop(int(r["landed"]), None)
            if landed is not None:
                track(self.idents, landed, Ident.from_json(r.get("ident")), True)
        elif "name" in r:
            self.names[int(r["node"])] = (os.fsencode(r["name"]), int(r["data"]))
        elif "writing" in r and "file" not in r:
            self.writing.add(int(r["writing"]))
        elif "written" in r:
            self.writing.discard(int(r["written"]))
        elif "file" in r:  # a compacted journal's record of a file or directory that exists
            node = int(r["file"])
            self.names[node] = (os.fsencode(r["path"]), int(r["data"]))
            if r.get("writing"):
                self.writing.add(node)
            ident = Ident.from_json(r.get("ident"))
            if ident is not None:
                self.idents[node] = ident
        elif "skipped" in r:
            self.skipped.append(Op.from_record(r["skipped"]))

    def _moved(self, op: Op) -> None:
        """A namespace change, as it happened in the mount: the names follow it."""
        if op.kind == UNLINK:
            self.names.pop(op.node, None)
            self.writing.discard(op.node)
        elif op.kind == RENAME:
            if op.replaced:
                self.names.pop(op.replaced, None)
                self.writing.discard(op.replaced)
            prefix = op.path + b"/"
            for node, (path, data) in list(self.names.items()):
                if path == op.path:
                    self.names[node] = (op.new, data)
                elif path.startswith(prefix):
                    self.names[node] = (op.new + path[len(op.path) :], data)


def replay(fd: int) -> Replay:
    """The journal open at `fd`, replayed; ValueError if it is not one."""
    records, end = read(fd)
    header = records[0] if records else None
    if not isinstance(header, dict) or header.get("fanfs_journal") != 1:
        raise ValueError("not a fanfs journal (or of another version)")
    rep = Replay(header, end=end)
    for r in records[1:]:
        try:
            rep.take(r)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"a record that is not one ({e}): {r!r}") from None
    return rep


class Dead:
    """A dead daemon's staging directory, locked, and what its journal says is left."""

    def __init__(self, path: Path, dir_fd: int, lock_fd: int, rep: Replay):
        self.path, self.fd, self._lock = path, dir_fd, lock_fd
        self.header = rep.header
        self.pending = list(rep.pending.values())
        for op in self.pending:  # whole copies: what DEST holds is not checked against `keep`
            op.narrow(0)
        self.skipped = [op for op in rep.skipped if op.kind == PUT]
        self.dropped = rep.dropped
        self.replicas = bool(rep.header.get("replicas"))
        wrote, self.writes_left = 0, False
        for name, at in kept_places(dir_fd, path):
            done = write_kept(dir_fd, name, at)
            if done is None:  # left as it is, for whoever looks (said in the log)
                self.writes_left = True
                continue
            wrote += done  # written: its buffers are not needed any more
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=at)
        if wrote:
            log.info("%s: wrote the %d WRITEs its daemon had answered into their files", path,
                     wrote)  # fmt: skip
        # What was being written when the daemon died: kept as it is, named.
        self.unclosed = {path: data for node, (path, data) in rep.names.items()
                         if node in rep.writing and data}  # fmt: skip
        with contextlib.suppress(OSError):  # a torn last line: the records appended follow
            os.ftruncate(lock_fd, rep.end)
        self.source = Source(name=str(path), token=str(rep.header.get("token", "x")),
                             open_local=self._open_local, record=self._record,
                             idents=rep.idents)  # fmt: skip

    def _open_local(self, data: int) -> int | None:
        try:
            return os.open(f"o{data}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None

    def _record(self, record: dict[str, Any]) -> None:
        """A landing or a skip, appended to its journal (a record lost to a full disk makes a
        later replay land that op again: safe, dest.py)."""
        try:
            fd = os.open(NAME, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=self.fd)  # fmt: skip
            try:
                os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("%s: its journal cannot be written: %s", self.path, e.strerror)

    def skip_landed_by_partner(self, dest: Dest) -> None:
        """With replicas: the ops the marker at DEST says were landed (by this daemon before
        it died, or by its partner after) are not applied again."""
        if not self.replicas:
            return
        marker = dst.read_marker(dest, self.source.token)
        if marker is not None:
            self.pending = [op for op in self.pending if op.seq > marker]

    def kept(self) -> dict[str, dict[str, str]]:
        """What stays here: {"files": {DEST path: local file}, "skipped": {...}}."""
        files = {os.fsdecode(path): f"o{data}" for path, data in self.unclosed.items()}
        files.update({os.fsdecode(op.path): f"o{op.data}" for op in self.pending
                      if op.kind == PUT})  # fmt: skip
        skipped = {os.fsdecode(op.path): f"o{op.data}" for op in self.skipped if op.kind == PUT}
        return {"files": files, "skipped": skipped}

    def finish(self, dest: Dest | None = None) -> None:
        """After its ops landed (or not): what is not needed goes; the rest is named in
        kept.json; the directory goes when it is empty (any thread)."""
        if dest is not None:
            if self.replicas and not self.pending:
                dst.remove_marker(dest, self.source.token)
            for op in self.dropped:  # a partial its last attempt could not remove, if any
                with contextlib.suppress(OSError, dst.LandingError):
                    remove_partial(dest, op.path, self.source.token, op.seq)
        kept = self.kept()
        keep = {*kept["files"].values(), *kept["skipped"].values()}
        # Writes that could not be written: their file stays, and the journal, so a later
        # recovery tries again.
        left = {KEPT_WRITES, NAME} if self.writes_left else set()
        for name in os.listdir(self.fd):
            if name in keep or name in left or (name == KEPT and keep):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=self.fd)
        if keep:
            fd = os.open(KEPT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600,
                         dir_fd=self.fd)  # fmt: skip
            with os.fdopen(fd, "w") as f:
                json.dump({"dest": self.header.get("dest"), **kept}, f, indent=1)
            names = sorted({*kept["files"], *kept["skipped"]})
            log.warning("%d files were not landed (never closed, or skipped): kept in %s "
                        "(kept.json names each): %s", len(keep), self.path,
                        ", ".join(names[:10]))  # fmt: skip
        self.close()
        if not keep:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)

    def close(self) -> None:
        for fd in (self._lock, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock = self.fd = -1


def open_dead(path: Path) -> Dead | None:
    """The dead daemon's directory at `path`, locked; None if it is not one of this user's
    with a journal, or its daemon is alive (it holds the lock)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(dir_fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(errno.EPERM, "not a private directory of this user")
        lock_fd = os.open(NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        os.close(dir_fd)
        return None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(lock_fd).st_ino != os.stat(NAME, dir_fd=dir_fd, follow_symlinks=False).st_ino:
            # A live daemon rewrote its journal (journal.py, compaction) between our open and
            # our lock: this one is its old file, which it let go.
            raise BlockingIOError(errno.EWOULDBLOCK, "rewritten meanwhile")
        rep = replay(lock_fd)
    except (OSError, ValueError) as e:
        if not isinstance(e, BlockingIOError):
            log.warning("%s: its journal cannot be read (%s): left as it is", path, e)
        os.close(lock_fd)
        os.close(dir_fd)
        return None
    return Dead(path, dir_fd, lock_fd, rep)


def find(parent: Path, dest: str) -> list[Dead]:
    """Dead daemons' directories in `parent` (a --local) whose DEST was `dest`, oldest first."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return []
    found = []
    for name in names:
        dead = open_dead(parent / name)
        if dead is None:
            continue
        if dead.header.get("dest") != dest:
            dead.close()
            continue
        found.append(dead)
    found.sort(key=lambda d: _started(d.header))
    return found


def _started(header: dict[str, Any]) -> float:
    try:
        return float(header.get("started", 0))
    except (TypeError, ValueError):
        return 0.0
