"""Logging set-up, done once by the CLI and refined by the daemon once it knows its rank.

Every line carries `rank/size@host`, so merged logs from many nodes stay readable.
"""

from __future__ import annotations

import logging
import os
import sys

_level = logging.INFO


def configure(verbosity: int, rank: int = 0, size: int = 1) -> None:
    global _level
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    env_level = os.environ.get("FANFS_LOG_LEVEL")
    if env_level and verbosity == 0:
        level = logging.getLevelName(env_level.upper())
    _level = level
    set_rank(rank, size)


def set_rank(rank: int, size: int) -> None:
    host = os.uname().nodename
    fmt = f"%(asctime)s {rank}/{size}@{host} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=_level, format=fmt, force=True, stream=sys.stderr)
