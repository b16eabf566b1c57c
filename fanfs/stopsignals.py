"""The daemons' stop signals from their first step, in a module light enough to import first.

SIGTERM, SIGINT and SIGHUP mean "stop" to `fanfs mount` and `fanfs output` whenever they come.
fanfs/lifecycle.py takes them once the daemon has imported what it runs on, a few hundred
milliseconds after its start. Before that, two ways lost a stop signal, and the daemon then
mounted and served as if none had come (test_a_stop_signal_at_any_moment_of_start_up hung so
in CI): a parent can make it ignore a signal (a script's `cmd &` ignores SIGINT, nohup SIGHUP,
and exec keeps both), and Python's own SIGINT, a KeyboardInterrupt raised wherever the daemon
is, is swallowed by any bare `except:` it lands in (Cython's set-up of fanfs._native registers
its memoryview types with collections.abc under one). So a daemon command's first step is an
`Early`: it takes the stop signals and notes the first one, raising nothing, and hands it to
the daemon's Lifecycle, which acts on it as on one that came in its own time. A signal sent
before that step (the interpreter's start and the CLI's imports, about 0.1 s) has its default
effect (nothing exists yet), or none if the parent made the daemon ignore it.

Concurrency: the main thread (Python runs signal handlers there only); `first` is written by
the handler and read by Lifecycle, both there.
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Early:
    """Takes the stop signals when made; `first`: the first one that came since (0: none)."""

    def __init__(self) -> None:
        self.first = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self.first:
            self.first = signum
