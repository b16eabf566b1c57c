"""The files this daemon found corrupt or unreadable: refused from then on, each logged once.

A file whose stored bytes fail their check (a CRC, a decoder, a short partition, a disk error,
a hostile catalog) is marked here by whoever met it first: a Python read or the native pool
(through its failure records). Every later READ of it is EIO at once; every other file keeps
being served.

Concurrency: the trio thread only (the pool's records arrive through a trio task).
"""

from __future__ import annotations

import logging
import os

from fanfs import catalog as cat
from fanfs.errors import CorruptFile

log = logging.getLogger(__name__)


class BadFiles:
    def __init__(self, catalog: cat.Catalog):
        self.catalog = catalog
        self._bad: set[int] = set()

    def __contains__(self, entry: int) -> bool:
        return entry in self._bad

    def __len__(self) -> int:
        return len(self._bad)

    def mark(self, entry: int, error: BaseException) -> None:
        """Refuse `entry` from now on; log why once (with the trace if it was unexpected)."""
        if entry not in self._bad:
            self._bad.add(entry)
            expected = isinstance(error, (CorruptFile, OSError))
            log.error("EIO for %s: %s", self.describe(entry),
                      error if expected else f"{type(error).__name__}: {error}",
                      exc_info=not expected)  # fmt: skip

    def refuse(self, entry: int) -> CorruptFile:
        """The error a read of a bad file raises (EIO at the FUSE edge)."""
        return CorruptFile(self.describe(entry))

    def describe(self, entry: int) -> str:
        return os.fsdecode(b"/" + self.catalog.path(entry))
