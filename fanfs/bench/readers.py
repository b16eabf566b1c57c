"""The reader processes of a bench pass (fanfs/bench/passes.py, fanfs/bench/epoch.py): started,
let go together, and what each measured gathered, with none left behind when a pass fails.

Concurrency: the bench's main thread; the readers are processes of their own (forked,
daemonic: the interpreter's exit never waits for one).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from fanfs.bench.machine import Window
from fanfs.errors import FanfsError

PASS_LIMIT_S = 3600.0  # a pass's readers all done within this, or the bench fails
BARRIER_S = 600.0  # every reader at the start within this (each first makes a 64 MiB buffer)
POLL_S = 1.0  # how soon a reader that died is noticed
KILL_WAIT_S = 10.0  # a reader killed (SIGKILL) is gone within this, even one in a FUSE read


def results(out: Any, procs: Sequence[Any]) -> list[Any]:
    """What each of the reader processes `procs` put on `out`, one item each. FanfsError within
    POLL_S when one ended with an error (its traceback is printed above, by its process), or
    when all have ended and an item is missing: waiting would last as long as a pass may."""
    got: list[Any] = []
    deadline = time.monotonic() + PASS_LIMIT_S
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=POLL_S))
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                why = f"a reader process failed (exit status {failed[0]})"
            elif None not in codes:  # all ended, their items flushed before they did
                why = f"{len(procs) - len(got)} reader processes ended without their measure"
            elif time.monotonic() > deadline:
                why = f"a pass lasted over {PASS_LIMIT_S:.0f} s"
            else:
                continue
            raise FanfsError(f"bench: {why}") from None
    return got


def _ready(procs: Sequence[Any], start: Any) -> None:
    """Wait at the barrier `start` with the readers: FanfsError within POLL_S of a reader's
    failure before it got there (it never will: the barrier is broken for all), or after
    BARRIER_S. Not covered: a reader killed while it waits at the barrier, which
    multiprocessing's condition then waits for (Ctrl-C still ends the bench)."""
    waiting = threading.Event()

    def watch() -> None:
        while not waiting.wait(POLL_S):
            if any(p.exitcode not in (None, 0) for p in procs):
                start.abort()  # (after the barrier let go, a failed reader fails the pass anyway)
                return

    watcher = threading.Thread(target=watch, name="fanfs-bench-ready", daemon=True)
    watcher.start()
    try:
        start.wait(timeout=BARRIER_S)
    except threading.BrokenBarrierError:
        failed = sorted({p.exitcode for p in procs if p.exitcode not in (None, 0)})
        why = (f"a reader process failed before the start (exit status "
               f"{', '.join(map(str, failed))})" if failed
               else f"the readers were not all ready in {BARRIER_S:.0f} s")  # fmt: skip
        raise FanfsError(f"bench: {why}; its error is above") from None
    finally:
        waiting.set()
        watcher.join(KILL_WAIT_S)  # (stuck in abort() only in the case not covered above)


def run(procs: Sequence[Any], start: Any, out: Any, window: Window | None = None) -> list[Any]:
    """Start the reader processes `procs` (daemonic), let them go at once (`start`: a barrier
    they wait at too) and return what each put on `out` (`results`); `window` is begun as they
    are let go and ended as the last measure comes in. Whatever ends a pass
    early (a reader's error, a stop signal) kills the readers still running, which would
    otherwise wait at the barrier for ever, so that the bench can unmount and exit."""
    done = False
    try:
        for p in procs:
            p.start()
        _ready(procs, start)
        if window is not None:
            window.begin()
        got = results(out, procs)
        if window is not None:
            window.end()
        done = True
        return got
    finally:
        for p in procs:
            if p.pid is None:
                continue  # never started
            if not done and p.is_alive():
                p.kill()
            p.join(None if done else KILL_WAIT_S)
