"""The reader processes of a bench pass (fanfs/bench/passes.py, fanfs/bench/epoch.py): started,
let go together, and what each measured gathered, with none left behind when a pass fails.

Concurrency: the bench's main thread; the readers are processes of their own (forked).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import Any

from fanfs.errors import FanfsError

PASS_LIMIT_S = 3600.0  # a pass's readers all done within this, or the bench fails


def results(out: Any, procs: Sequence[Any]) -> list[Any]:
    """What each of the reader processes `procs` put on `out`, one item each. FanfsError at
    once when one ended without putting its own (its error is printed above, by its process):
    waiting for it would last as long as a pass may (PASS_LIMIT_S)."""
    got: list[Any] = []
    deadline = time.monotonic() + PASS_LIMIT_S
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise FanfsError(
                    f"bench: a reader process failed (exit status {failed[0]})"
                ) from None
            if time.monotonic() > deadline:
                raise FanfsError(f"bench: a pass lasted over {PASS_LIMIT_S:.0f} s") from None
    return got


def run(procs: Sequence[Any], start: Any, out: Any) -> list[Any]:
    """Start the reader processes `procs`, let them go at once (`start`: a barrier they wait
    at too) and return what each put on `out` (`results`). Whatever ends a pass early (a
    reader's error, a stop signal) ends the readers still running too: the bench can then
    unmount and exit, where they would have waited for ever at the barrier."""
    for p in procs:
        p.start()
    done = False
    try:
        start.wait(timeout=600)
        got = results(out, procs)
        done = True
        return got
    finally:
        for p in procs:
            if not done and p.is_alive():
                p.terminate()
            p.join()
