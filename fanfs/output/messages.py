"""The replicas' messages (replicas.py): bytes in one format, checked as data before use.

Each is a HEADER (kind, seq, part, parts, mode, path and new lengths) then the path, the new
path and a piece of file. `decode` refuses anything outside the format (BadMessage): a size
over MESSAGE_MAX is refused before this by the receive (world.recv_bytes), a path with NUL,
"." or "..", an unknown kind, an op carrying a piece, a piece out of range.
"""

from __future__ import annotations

import struct

from fanfs.output.journal import MKDIR, RENAME, RMDIR, UNLINK

PIECE = 8 << 20  # bytes of file per message: bounded memory per message on both sides
HEADER = struct.Struct("<BQIIIHH")  # kind, seq, part, parts, mode, len(path), len(new)
PATH_MAX = 4096
MESSAGE_MAX = HEADER.size + 2 * PATH_MAX + PIECE
PARTS_MAX = (1 << 40) // PIECE  # a file of 1 TiB at most
M_PUT, M_HELD, M_LANDED, M_BYE, M_HB = 1, 2, 3, 4, 5
M_OPS = {RENAME: 6, UNLINK: 7, MKDIR: 8, RMDIR: 9}
OPS_M = {v: k for k, v in M_OPS.items()}


class BadMessage(ValueError):
    """A peer's message that breaks the format."""


def encode(kind: int, seq: int = 0, path: bytes = b"", new: bytes = b"", mode: int = 0,
           part: int = 0, parts: int = 0, data: bytes = b"") -> bytes:  # fmt: skip
    return HEADER.pack(kind, seq, part, parts, mode, len(path), len(new)) + path + new + data


def decode(msg: bytes) -> tuple[int, int, int, int, int, bytes, bytes, memoryview]:
    """(kind, seq, part, parts, mode, path, new, data) of a peer's message; BadMessage."""
    if len(msg) < HEADER.size:
        raise BadMessage(f"{len(msg)} bytes")
    kind, seq, part, parts, mode, lp, ln = HEADER.unpack_from(msg)
    body = memoryview(msg)[HEADER.size :]
    if lp > PATH_MAX or ln > PATH_MAX or lp + ln > len(body):
        raise BadMessage("path lengths")
    path, new, data = bytes(body[:lp]), bytes(body[lp : lp + ln]), body[lp + ln :]
    for p in (path, new):
        if b"\0" in p or b".." in p.split(b"/") or b"." in p.split(b"/"):
            raise BadMessage(f"path {p!r}")
    if kind == M_PUT:
        if not path or not 0 <= part < parts <= PARTS_MAX or len(data) > PIECE:
            raise BadMessage("piece out of range")
    elif kind in OPS_M:
        if not path or (kind == M_OPS[RENAME]) != bool(new) or part or parts or data:
            raise BadMessage("op without its paths, or with a piece")
    elif kind not in (M_HELD, M_LANDED, M_BYE, M_HB):
        raise BadMessage(f"kind {kind}")
    return kind, seq, part, parts, mode & 0o777, path, new, data
