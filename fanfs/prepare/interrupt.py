"""Interrupts during prepare (SIGINT, SIGTERM), delivered only at safe points."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger(__name__)


class Interrupt:
    """SIGINT/SIGTERM during prepare, delivered only at safe points.

    Raising from the signal handler itself is not safe: the exception can surface inside code
    that swallows it (an at-fork hook of the logging module did, and prepare then finished
    instead of stopping). The handler only records the signal; the loops call `check`.
    """

    def __init__(self) -> None:
        self._hit = threading.Event()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._hit.set()

    def check(self) -> None:
        if self._hit.is_set():
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self._hit.clear()
        previous = {s: signal.signal(s, self._record) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


stop = Interrupt()
