"""Unit tier: fanfs.bench.epoch's CPU by thread (what `fanfs bench`'s "cpu" lines report):
what kind a thread is from its name, and the time each kind spent (on a CPU, or waiting for
one) between two readings, read from real processes' threads; and fanfs.bench.machine's
figures (the "machine" lines): the machine's busy CPUs, and the slowest reads' share of a
pass."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from fanfs.bench import budget, epoch, machine
from fanfs.threads import name_os_thread


def test_thread_kinds_from_their_names() -> None:
    kind = epoch.thread_kind
    assert kind("anything", True) == "loop"  # the main thread
    assert kind("fanfs-serve-3", False) == "serve" and kind("fanfs-plan-12", False) == "plan"
    assert kind("fanfs-front", False) == "front" and kind("mpi-progress", False) == "mpi-progress"
    assert kind("Trio thread 4", False) == "trio"
    assert kind("_read from <tas", False) == "trio"  # trio names a worker for its job
    assert kind("python3.11", False, "python3.11") == "other"  # never named


def _burn(steps: list[threading.Event]) -> None:
    burnt, rename, renamed, stop = steps
    name_os_thread("fanfs-plan-0")
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
    burnt.set()
    rename.wait()
    name_os_thread("fanfs-serve-1")  # as trio renames its workers for each job
    renamed.set()
    stop.wait()


def test_a_renamed_threads_past_is_not_counted_again() -> None:
    """A thread that spent 0.3 s as "fanfs-plan-0", then renamed, spends nothing more: between
    a reading before the rename and one after, no kind is given its past."""
    steps = [threading.Event() for _ in range(4)]
    t = threading.Thread(target=_burn, args=(steps,))
    t.start()
    try:
        assert steps[0].wait(10)
        before = epoch.threads_now([os.getpid()])
        assert epoch.by_kind(epoch.spent({}, before))["plan"] >= 0.29
        steps[1].set()
        assert steps[2].wait(10)
        took = epoch.by_kind(epoch.spent(before, epoch.threads_now([os.getpid()])))
        assert took.get("serve", 0) < 0.1 and "plan" not in took, took
        assert sum(took.values()) < 0.2, took
    finally:
        for step in steps:
            step.set()
        t.join()


# Says it is ready, burns argv[1] seconds of CPU once told to, says so, and waits to be ended.
BURN = (
    "import sys, time\nprint(flush=True)\nsys.stdin.readline()\n"
    "end = time.process_time() + float(sys.argv[1])\n"
    "while time.process_time() < end:\n    pass\nprint(flush=True)\nsys.stdin.readline()\n"
)


def test_burns_on_one_cpu_wait_for_it() -> None:
    """A process burning 0.4 s and one burning 0.1 s on one CPU: each is runnable while the
    other runs, and what the "cpu" lines call "waited for a CPU" counts that (schedstat's
    run-queue time): the short one waits through the long one's turns, the long one about as
    long as the short one ran, less than its own time."""
    cpu = min(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", BURN, burn], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
             for burn in ("0.4", "0.1")]  # fmt: skip
    try:
        for p in procs:
            os.sched_setaffinity(p.pid, {cpu})
            assert p.stdout is not None and p.stdout.readline() == "\n"
        before = epoch.threads_now([p.pid for p in procs])
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "\n"
        after = epoch.threads_now([p.pid for p in procs])
        burnt, waited = epoch.spent(before, after), epoch.spent(before, after, epoch.WAITED)
        long, short = ((p.pid, "loop") for p in procs)  # (each process's main thread)
        assert burnt[long] >= 0.39 and burnt[short] >= 0.09, burnt
        assert waited.get(short, 0) >= 0.05 and waited.get(long, 0) < burnt[long], waited
    finally:
        for p in procs:
            p.kill()
            p.communicate()  # (and its pipes closed)


def test_the_cpu_line_says_what_waited() -> None:
    """A "cpu" line: each kind's CPU per file, then what waited for a CPU; a kind under half a
    microsecond is left out, and so is the wait where none was measured."""
    row = {"cpu_by_thread_us": {"plane": 100.2, "front": 0.4},
           "waited_by_thread_us": {"plane": 410.4, "front": 3.0}}  # fmt: skip
    line = "cpu epoch 128K cold x1 (us/file): plane 100; waited for a CPU: plane 410 front 3"
    assert budget.thread_line(row, "epoch 128K cold x1") == line
    row["waited_by_thread_us"] = {}
    assert budget.thread_line(row, "x") == "cpu x (us/file): plane 100"


def test_the_machines_busy_cpus_count_a_burn() -> None:
    """fanfs.bench.machine's Window counts what a thread of this process burns (the machine's
    other work only adds to it): the bench's "machine" lines."""
    window, before, own = machine.Window(), machine.busy_cpu_s(), time.process_time()
    window.begin()
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
    burnt = time.process_time() - own
    window.end()
    # (/proc/stat counts in ticks: 10 ms here, so a tick's worth less may show)
    assert machine.busy_cpu_s() - before >= burnt - 2 / os.sysconf("SC_CLK_TCK")
    assert window.cpus >= 0.8, window.cpus  # one CPU burnt all along, at least
    cpus = window.cpus
    window.end()  # (once a begin: again, nothing)
    assert window.cpus == cpus


def test_busy_ticks_are_neither_idle_nor_iowait_nor_guest_twice() -> None:
    """/proc/stat: user nice system idle iowait irq softirq steal guest guest_nice."""
    assert machine.busy_ticks("cpu  100 5 50 1000 30 1 2 3 40 0") == 161
    assert machine.busy_ticks("cpu 1 2 3 4") == 6  # an older kernel's shorter line


def test_the_slowest_reads_share_of_a_pass() -> None:
    """What the "machine" lines call the part of the readers' time the slowest 5 % took."""
    even = [1.0] * 100
    assert machine.tail_share(even) == pytest.approx(0.05)
    stalled = [1.0] * 95 + [100.0] * 5  # five stalls of a hundred times a read
    assert machine.tail_share(stalled) == pytest.approx(500 / 595)
    assert machine.tail_share([3.0, 1.0]) == pytest.approx(0.75)  # at least one read
    assert machine.tail_share([]) == 0.0 and machine.tail_share([0.0, 0.0]) == 0.0


def test_the_most_the_cpus_allow() -> None:
    """What the "machine" lines call the most of native's speed the CPUs allow: a pass that read
    at 0.68 of native with 1.66 of 2 CPUs busy could read at 0.82 with both busy at the same
    CPU a file; with every CPU busy a pass is at its bound; with none counted, no bound."""
    assert machine.cpu_bound(0.68, 1.66, 2) == pytest.approx(0.819, abs=1e-3)
    assert machine.cpu_bound(0.5, 2.0, 2) == pytest.approx(0.5)
    assert machine.cpu_bound(0.34, 1.74, 16) == pytest.approx(3.126, abs=1e-3)
    assert machine.cpu_bound(0.9, 0.0, 2) is None


def test_a_naps_cost_is_cpu_no_longer_than_the_nap() -> None:
    """What the bench says a thread's short sleep costs the machine: some CPU (the system call
    and the wake-up), never more than the time the sleep took."""
    cpu, took = machine.wake_cpu_us(200)
    assert took >= machine.WAKE_NAP_S * 1e6, (cpu, took)
    assert 0 < cpu <= took, (cpu, took)
