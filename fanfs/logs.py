"""Logging set-up, done once by the CLI and refined by the daemon once it knows its rank.

Every line carries `rank/size@host`, so merged logs from many nodes stay readable.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable

_level = logging.INFO


def configure(verbosity: int, rank: int = 0, size: int = 1) -> None:
    global _level
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    env_level = os.environ.get("FANFS_LOG_LEVEL", "").strip()  # checked by the CLI first
    if env_level and verbosity == 0:
        level = logging.getLevelName(env_level.upper())
    _level = level
    set_rank(rank, size)


def set_rank(rank: int, size: int) -> None:
    host = os.uname().nodename
    fmt = f"%(asctime)s {rank}/{size}@{host} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=_level, format=fmt, force=True, stream=sys.stderr)


class Throttle:
    """For a warning that may repeat on a hot path (a failing disk under every READ of a
    file): `due(key)` is None while `key` was logged less than `period` seconds ago, else how
    many of its warnings were held back since (log then, and say so). Remembers at most `most`
    keys, the oldest forgotten first."""

    def __init__(self, period: float = 60.0, most: int = 4096):
        self.period, self.most = period, most
        self._seen: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def due(self, key: Hashable) -> int | None:
        now = time.monotonic()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.period:
            self._seen[key] = (last[0], last[1] + 1)
            return None
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.most:
            self._seen.popitem(last=False)
        return last[1] if last is not None else 0
