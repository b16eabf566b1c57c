"""What a peer may ask of this daemon: stored bytes of a file it holds, answered from its store.

A request is (entry, offset, length) of stored bytes: refused (None) unless the entry is a file
this daemon holds and the range lies within its stored bytes; a large raw file is checked once
as a whole before any range of it is served. Every request is input from another process and
checked like input (fanfs/node/transport/mpi.py has already bounded its length).

The transport is handed this server: requests a plain read answers go to `locate` and the
reads (`cached`, `pread`), which the MPI transport's own threads call without the event loop;
the rest to `serve` in the event loop. The server knows neither the transport nor the Reader.

Concurrency: `serve` in the trio thread; `locate`, `cached` and `pread` from any thread (the
catalog is immutable, the set of checked large files only grows).
"""

from __future__ import annotations

import logging

from fanfs import catalog as cat
from fanfs.errors import CorruptFile
from fanfs.node.sources import Local

log = logging.getLogger(__name__)


class PeerServer:
    def __init__(self, catalog: cat.Catalog, local: Local):
        self.catalog = catalog
        self.local = local

    def _valid(self, entry: int, offset: int, length: int) -> bool:
        c = self.catalog
        if not (0 <= entry < c.n_entries and c.is_file[entry]) or not self.local.mine(entry):
            return False
        return offset >= 0 and length > 0 and offset + length <= int(c.stored_len[entry])

    async def serve(self, entry: int, offset: int, length: int) -> bytes | None:
        """The stored bytes a peer asked for, or None if this daemon cannot serve them."""
        if not self._valid(entry, offset, length):
            return None
        try:
            if self.local.large(entry):
                await self.local.verify(entry)
            return await self.local.read(entry, offset, length, count=False)
        except (CorruptFile, OSError) as e:
            log.warning("cannot serve /%s to a peer: %s", self.catalog.path(entry).decode(
                errors="replace"), e)  # fmt: skip
            return None

    def locate(self, entry: int, offset: int, length: int) -> tuple[int, int] | None:
        """(partition, start) of a request a plain read answers, or None: `serve` refuses what
        is wrong and checks a large raw file first."""
        if not self._valid(entry, offset, length):
            return None
        if self.local.large(entry) and not self.local.is_verified(entry):
            return None
        return self.local.where(entry, offset)

    def cached(self, part: int, start: int, length: int) -> bytearray | None:
        """The bytes if the page cache holds them all (never waits for the disk), else None."""
        return self.local.cached(part, start, length)

    def pread(self, part: int, start: int, length: int) -> bytes:
        """Exactly the bytes (may wait for the disk; OSError on failure)."""
        return self.local.pread(part, start, length)
