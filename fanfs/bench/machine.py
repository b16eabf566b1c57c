"""What a pass says beside its speed: whether the machine's CPUs were all busy while it ran, and
how much of the readers' time its slowest reads held.

The two tell a slow case's kind apart. A case bound by the CPUs keeps them all busy; a case
that waits (a queue, a sleep, a lock) leaves some idle. A pass held up by a few stalls shows
most of the readers' time in its slowest reads; a pass that is slow evenly does not. On `vm`
a planned global epoch over 4 daemons kept 1.5-1.7 of its 2 CPUs busy, and its slowest 5 % of
reads held about two thirds of the readers' time (docs/performance.md, "A planned epoch's
time, read by read"). From the two, `cpu_bound` says how fast the machine's CPUs would let a
case read at the CPU it spent a file.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

TAIL = 0.05  # the share of a pass's reads, the slowest, whose part of its time is reported
WAKE_NAP_S = 20e-6  # the data plane's nap between looks while traffic flows (csrc/plane.h)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent since boot on anything but idling and waiting
    for I/O (/proc/stat's first line, `busy_ticks`)."""
    with open("/proc/stat") as f:
        return busy_ticks(f.readline()) / os.sysconf("SC_CLK_TCK")


def busy_ticks(line: str) -> int:
    """/proc/stat's "cpu" line's ticks of user, nice, system, irq, softirq and steal (the time
    a virtual CPU wanted to run and its host ran something else); not idle, not iowait, and
    not guest and guest_nice, which user and nice count already."""
    fields = [int(x) for x in line.split()[1:9]]
    fields += [0] * (8 - len(fields))  # (an older kernel lists fewer: those it lacks are 0)
    return sum(fields) - fields[3] - fields[4]


class Window:
    """The machine's CPUs busy over a pass, on average (`cpus`): from `begin` to `end`. The
    reader processes' runner (fanfs/bench/readers.py) takes them as the readers are let go
    and as the last one's measure comes in, so that their start (a 64 MiB buffer each) and
    exit are not counted; a pass with no such runner (a DataLoader's) is taken over the
    caller's own call. The kernel counts in ticks (10 ms here): a pass of a few ticks gets a
    coarse figure, and a shorter one may get none at all (the bench's passes last 0.5 s or
    more, but for the smallest `--total`)."""

    def __init__(self) -> None:
        self.cpus = 0.0
        self._began: tuple[float, float] | None = None

    def begin(self) -> None:
        self._began = (busy_cpu_s(), time.monotonic())

    def end(self) -> None:
        """(Once after each `begin`: a second call changes nothing.)"""
        if self._began is not None:
            busy, at = self._began
            self.cpus = (busy_cpu_s() - busy) / max(1e-3, time.monotonic() - at)
            self._began = None


def cpu_bound(ratio: float, busy: float, cpus: int) -> float | None:
    """The most of native's speed the machine's `cpus` allow a side that read at `ratio` of
    native's while keeping `busy` CPUs busy on average: the pass's CPU work, the same a file,
    spread over every CPU with none idle (`ratio` x `cpus` / `busy`). None when the pass kept
    nothing busy that the kernel counted. A case near its bound is held by the cores, one far
    below it by something it waits for. The work is what the pass spent here, with every
    process of every "node" on the same cores: nodes of their own may spend less a file."""
    return ratio * cpus / busy if busy > 0 else None


def tail_share(lat: Sequence[float], share: float = TAIL) -> float:
    """The part of the summed per-file times that the slowest `share` of the files took (at
    least one file); 0 for no files."""
    if not lat:
        return 0.0
    slowest = sorted(lat, reverse=True)[: max(1, math.ceil(len(lat) * share))]
    total = math.fsum(lat)
    return math.fsum(slowest) / total if total > 0 else 0.0


def wake_cpu_us(naps: int = 2000) -> tuple[float, float]:
    """What one short sleep of a thread costs this machine, in microseconds: (its CPU time,
    its time). A thread that polls by napping, as the data plane does between its looks for
    MPI's messages, pays that CPU each look. On `vm` (a VM whose idle virtual CPUs halt) a 20 us
    nap costs 15-20 us of CPU, whatever the system call (ppoll, nanosleep, futex), so a plane
    that looks every 40 us spends about 40 % of a core while traffic flows
    (docs/performance.md, "What a look costs")."""
    began, at = time.thread_time(), time.monotonic()
    for _ in range(naps):
        time.sleep(WAKE_NAP_S)
    return ((time.thread_time() - began) / naps * 1e6, (time.monotonic() - at) / naps * 1e6)
