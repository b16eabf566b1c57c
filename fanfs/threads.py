"""The daemon's threads named for the system: `top -H`, `ps -L`, perf and `fanfs bench` read a
thread's name from /proc/PID/task/TID/comm, which Python's own thread names never reach (the C
threads name themselves the same way, docs/threads.md)."""

from __future__ import annotations

import contextlib
import ctypes
import threading

PR_SET_NAME = 15  # linux/prctl.h
NAME_MAX = 15  # the kernel keeps 15 bytes of a name
# The name of a daemon's main thread (and so of its process, /proc/PID/comm) once all that is
# left of it is MPI's finalize, which waits for the job's other ranks (fanfs/lifecycle.py).
FINALIZING = "fanfs-finalize"


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (default: its Python name), cut to what the kernel
    keeps; where prctl is missing, nothing."""
    raw = (name or threading.current_thread().name).encode()[:NAME_MAX]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)


def finalizing(pid: int) -> bool:
    """Whether daemon `pid` has done all its work and only waits in MPI's finalize."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().rstrip(b"\n") == FINALIZING.encode()
    except OSError:
        return False
