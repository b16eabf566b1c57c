"""Unit tier: fanfs.bench.readers, how a pass gathers what its reader processes measured (real
processes, forked as the bench forks them)."""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable
from typing import Any

import pytest

from fanfs.bench import readers
from fanfs.errors import FanfsError

# The bench forks its readers; Python 3.12 and later warn when a process with threads forks
# (trio's idle workers of earlier tests may be there), and warnings are errors here.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")


def _puts(out: Any) -> None:
    out.put("measured")


def _fails() -> None:
    raise RuntimeError("a reader's error (printed by its process: expected in this test)")


def _raised_within_30_s(call: Callable[[], object]) -> str:
    """The FanfsError `call` raised (its message), which it must within 30 s: it runs in a
    thread of its own, never joined if it hangs."""
    raised: list[FanfsError] = []

    def run() -> None:
        try:
            call()
        except FanfsError as e:
            raised.append(e)

    waiting = threading.Thread(target=run, daemon=True)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive() and len(raised) == 1, raised
    return str(raised[0])


def test_a_reader_that_fails_ends_the_pass_at_once() -> None:
    """A reader process that dies before it puts its measure (an open that failed, say) fails
    the pass within seconds: the bench used to wait an hour for it."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_puts, args=(out,), daemon=True),
             ctx.Process(target=_fails, daemon=True)]  # fmt: skip
    for p in procs:
        p.start()
    assert "exit status 1" in _raised_within_30_s(lambda: readers.results(out, procs))
    for p in procs:
        p.join(10)


def test_every_reader_s_measure_is_gathered() -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_puts, args=(out,), daemon=True) for _ in range(3)]
    for p in procs:
        p.start()
    assert readers.results(out, procs) == ["measured"] * 3
    for p in procs:
        p.join(10)
        assert p.exitcode == 0


def _quiet() -> None:
    pass


def test_readers_that_end_without_their_measure_end_the_pass() -> None:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_quiet, daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    with pytest.raises(FanfsError, match="2 reader processes ended without their measure"):
        readers.results(ctx.Queue(), procs)


def _fails_before_the_start(start: Any) -> None:
    raise RuntimeError("a reader's error before the start (printed by its process: expected)")


def _waits_at_the_start(start: Any, out: Any) -> None:
    start.wait(timeout=60)
    out.put("measured")


def test_a_reader_that_fails_before_the_start_ends_the_pass_at_once() -> None:
    """A reader that dies before the start barrier (its buffer could not be made, say) fails
    the pass within seconds, and the readers waiting there with the bench are let go: the
    bench used to wait BARRIER_S, 600 s, for it."""
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_waits_at_the_start, args=(start, out), daemon=True),
             ctx.Process(target=_fails_before_the_start, args=(start,), daemon=True)]  # fmt: skip
    why = _raised_within_30_s(lambda: readers.run(procs, start, out))
    assert "failed before the start (exit status 1)" in why
    assert all(not p.is_alive() for p in procs)
