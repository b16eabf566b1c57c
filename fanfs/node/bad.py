"""The files found bad: bytes that fail their check or decode, or a hostile catalog's entry,
are EIO for that file alone from then on, logged once with its path. A failure that may pass
(the disk's EIO, memory, every source of a peer's file gone) fails that READ alone, its warning
throttled: the next READ tries again.

Concurrency: the trio thread (the reader), and the native pool's error callback, which runs
there too; the set only grows.
"""

from __future__ import annotations

import logging
import os

from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.logs import Throttle

log = logging.getLogger(__name__)


class BadFiles:
    def __init__(self, catalog: cat.Catalog):
        self.catalog = catalog
        self._bad: set[int] = set()
        self._throttle = Throttle()  # a failing disk under every READ: a line a minute a file

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

    def failed(self, entry: int, error: BaseException) -> CorruptFile:
        """The error a failed read of `entry` raises (EIO at the FUSE edge). Only bytes proved
        bad (a check, a decode, a hostile catalog) mark the file bad; the disk, memory or a
        peer failing now fail this READ alone (the native pool draws the same line)."""
        if isinstance(error, (OSError, MemoryError)):
            held = self._throttle.due(entry)
            if held is not None:
                log.warning("EIO for %s (this read only): %s%s", self.describe(entry),
                            error or type(error).__name__,
                            f" ({held} more since the last warning)" if held else "")  # fmt: skip
            return CorruptFile(self.describe(entry))
        self.mark(entry, error)
        return self.refuse(entry)
