"""What the MPI transport's threads hand each other: commands for the MPI thread, reads for
the server threads, sends under way. Records only (frozen, slotted), no behaviour.

Concurrency: a record is built in one thread and handed over whole through a queue; nobody
changes it afterwards (a `Fetch` it carries is the exception: inbox.py says who writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from fanfs.node.transport.inbox import TAG_REQUEST, Fetch


# Commands from trio tasks and threads to the MPI thread (one queue, read only by that thread).
@dataclass(frozen=True, slots=True)
class Send:
    """Post the receive of a reply, then send the request header."""

    peer: int
    tag: int
    header: np.ndarray
    job: Fetch
    kind: int = TAG_REQUEST  # or TAG_BATCH


@dataclass(frozen=True, slots=True)
class Cancel:
    """The fetch of `tag` timed out: cancel its receives."""

    tag: int


@dataclass(frozen=True, slots=True)
class Reply:
    """Send a peer the stored bytes it asked for (None: an empty refusal) of `entry`."""

    peer: int
    tag: int
    data: bytes | bytearray | memoryview | None
    entry: int
    direct: bool = False  # read by the transport's threads, not through the event loop
    reserved: int = 0  # reply bytes the server side reserved for it, released once sent
    files: int = 1  # files it answers (a batch's)
    taken_ns: int = 0  # monotonic_ns: its request taken (0: not timed, the event loop's)
    started_ns: int = 0  # ... its read begun (a server thread took it)
    ready_ns: int = 0  # ... its bytes read


@dataclass(frozen=True, slots=True)
class Bye:
    """Tell every live peer this daemon has unmounted."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Cancel the standing receives and end the MPI thread."""


Command = Send | Cancel | Reply | Bye | Stop


@dataclass(frozen=True, slots=True)
class Read:
    """A server thread's read for a peer: the reply is the pieces back to back."""

    peer: int
    tag: int  # the reply's
    entry: int  # (the first, for a batch: for the log and the counters)
    pieces: tuple[tuple[int, int, int], ...]  # (partition, start, length)
    taken_ns: int = 0  # monotonic_ns: its request taken


class Outgoing(NamedTuple):
    """An MPI send under way: its request, the buffer it sends (kept alive until it is
    complete), the reply bytes to release then, its peer, and when it was posted (monotonic)."""

    req: Any
    buf: Any
    reserved: int
    peer: int
    at: float
