"""How daemons ask each other for stored file bytes. `mpi.py` is the one implementation that
crosses nodes; with a single daemon nothing is remote and no transport exists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

# Serves a peer's request: (entry, offset, length) -> the stored bytes, or None if this daemon
# cannot (the requester then tries another source).
ServeFn = Callable[[int, int, int], Awaitable[bytes | memoryview | None]]


class PeerTimeout(Exception):
    """A peer did not answer within the peer timeout; it is routed around from now on."""


class Transport(Protocol):
    rank: int
    size: int

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None: ...

    def is_dead(self, peer: int) -> bool: ...

    def statistics(self) -> dict[str, Any]: ...
