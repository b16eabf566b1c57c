"""Unit tier: fanfs.bench.readers, how a pass gathers what its reader processes measured (real
processes, forked as the bench forks them)."""

from __future__ import annotations

import multiprocessing as mp
import threading
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


def test_a_reader_that_fails_ends_the_pass_at_once() -> None:
    """A reader process that dies before it puts its measure (an open that failed, say) fails
    the pass within seconds: the bench used to wait an hour for it."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_puts, args=(out,), daemon=True),
             ctx.Process(target=_fails, daemon=True)]  # fmt: skip
    for p in procs:
        p.start()
    raised: list[BaseException] = []

    def gather() -> None:
        try:
            readers.results(out, procs)
        except FanfsError as e:
            raised.append(e)

    waiting = threading.Thread(target=gather, daemon=True)  # never joined if it hangs
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive()
    assert len(raised) == 1 and "exit status 1" in str(raised[0]), raised
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
    raised: list[BaseException] = []

    def run() -> None:
        try:
            readers.run(procs, start, out)
        except FanfsError as e:
            raised.append(e)

    waiting = threading.Thread(target=run, daemon=True)  # never joined if it hangs
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive()
    assert len(raised) == 1 and "failed before the start (exit status 1)" in str(raised[0]), raised
    assert all(not p.is_alive() for p in procs)
