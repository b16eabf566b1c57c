"""What a holder keeps for its owner (`fanfs output --replicas 2`, replicas.py): the owner's
ops not landed yet, in order, each put's bytes in this node's staging directory
(`r<owner>-<seq>`), forgotten as the owner says they landed, and landed from here into the
owner's DEST if the owner dies first.

Bounds: at most MAX_HELD ops and HELD_PATH_BYTES of their paths (a peer cannot grow our
memory without bound: an owner's journal is capped at MAX_HELD with replicas, and more
changes fail ENOSPC there); the bytes are bounded by this node's disk (ENOSPC is an error
like any other). A piece out of order, or too many ops, is a BadMessage: its sender is taken
for a dead peer.

Landing from here: a sequence of ops is not safe to apply twice (unlink old, rename new to
old: again, and the wrong file is gone), so the owner records at DEST how far it has landed
(dest.py's marker), and `land` skips every op up to that record, read again before each op;
only the op the owner was applying when it died may be applied twice, and each op alone is
idempotent. A put whose pieces did not all arrive was never closed by its writer (the close
waits for "held"): it is skipped.

Concurrency: the MPI thread's (replicas.py) until it has stopped; then `land` runs in a
worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os

from fanfs.node.staging import StagingDir
from fanfs.output.apply import apply
from fanfs.output.dest import Dest, LandingError, read_marker, remove_marker
from fanfs.output.journal import PUT, Op
from fanfs.output.messages import PIECE, BadMessage

log = logging.getLogger(__name__)

# Ops held for the owner, and their paths' bytes at most (module docstring).
MAX_HELD = 1 << 14
HELD_PATH_BYTES = 64 << 20


class Held:
    """The ops of rank `owner` kept here, whose files land in `owner_dest`; `owner_token`
    is its name there (temporary names, its marker)."""

    def __init__(self, staging: StagingDir, owner: int, owner_dest: str, owner_token: str):
        self.staging = staging
        self.owner = owner
        self.owner_dest = owner_dest
        self.owner_token = owner_token
        self.ops: list[Op] = []  # not landed, in order
        self.landed = 0  # the owner said every op up to this one is at DEST
        self._path_bytes = 0
        self._incomplete: dict[int, int] = {}  # put seq -> pieces still to come

    def check_room(self, path: bytes, new: bytes) -> None:
        """Room for one more op with these paths; BadMessage if there is none."""
        if len(self.ops) >= MAX_HELD or self._path_bytes > HELD_PATH_BYTES:
            raise BadMessage(f"more than {MAX_HELD} changes or {HELD_PATH_BYTES} bytes of "
                             "paths not landed")  # fmt: skip
        self._path_bytes += len(path) + len(new)

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def _name(self, seq: int) -> str:
        return f"r{self.owner}-{seq}"

    def piece(self, seq: int, path: bytes, mode: int, part: int, parts: int,
              data: memoryview) -> bool:  # fmt: skip
        """Piece `part` of `parts` of put `seq`, written to its file; True once it is whole."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if part == 0:
            flags |= os.O_CREAT | os.O_TRUNC
            self.ops.append(Op(seq, PUT, path, data=seq, mode=mode))
            self._incomplete[seq] = parts
        elif self._incomplete.get(seq, 0) != parts - part:
            raise BadMessage(f"piece {part} of {parts} of {seq} out of order")
        fd = os.open(self._name(seq), flags, 0o600, dir_fd=self.staging.fd)
        try:
            os.pwrite(fd, data, part * PIECE)
        finally:
            os.close(fd)
        op = next(op for op in reversed(self.ops) if op.seq == seq)
        op.grew(part * PIECE + len(data))
        self._incomplete[seq] -= 1
        if self._incomplete[seq] == 0:
            del self._incomplete[seq]
            return True
        return False

    def forget(self, seq: int) -> None:
        """Every op up to `seq` is at DEST: they go, with their files."""
        self.landed = max(self.landed, seq)
        keep = []
        for op in self.ops:
            if op.seq <= seq:
                if op.kind == PUT:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._name(op.seq), dir_fd=self.staging.fd)
            else:
                keep.append(op)
        self.ops = keep
        self._path_bytes = sum(len(op.path) + len(op.new) for op in keep)

    def _open_copy(self, seq: int) -> int | None:
        if seq in self._incomplete:
            return None  # never closed by its writer: the close waited for all of it
        try:
            return os.open(self._name(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=self.staging.fd)  # fmt: skip
        except FileNotFoundError:
            return None

    def land(self) -> str:
        """In a worker thread, after the MPI thread stopped: the owner's ops it did not land,
        into the owner's DEST, skipping what its marker says it landed. Why not all landed
        ("": they did)."""
        log.warning("rank %d left %d changes not at DEST: landing them from the copies here",
                    self.owner, len(self.ops))  # fmt: skip
        try:
            dest = Dest(self.owner_dest)
        except OSError as e:
            failed = f"{self.owner_dest}: {e.strerror}"
            log.error("rank %d's DEST cannot be opened from here (%s): its changes are kept in %s",
                      self.owner, failed, self.staging.path)  # fmt: skip
            return failed
        while self.ops:
            op = self.ops[0]
            try:
                if op.seq > (read_marker(dest, self.owner_token) or 0):
                    apply(dest, op, self._open_copy, f"{self.owner_token}-r", None, strict=False)
            except (OSError, LandingError) as e:
                failed = f"{op.kind} {op.describe()}: {e}"
                log.error("rank %d's %s could not land from here; kept in %s",
                          self.owner, failed, self.staging.path)  # fmt: skip
                return failed
            self.forget(op.seq)
        remove_marker(dest, self.owner_token)
        return ""

    def remove_marker(self) -> None:
        """The owner landed everything: its marker at DEST goes."""
        remove_marker(Dest(self.owner_dest), self.owner_token)
