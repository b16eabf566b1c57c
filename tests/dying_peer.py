"""A rank for tests/mpi/test_mpi.py that dies mid-send: it joins a fanfs job's start-up like a
daemon and, once the test says `go`, asks rank 0 for a file of rank 0's on each of its two
communicators (the MPI thread's, the data plane's) and waits until the replies are on their
way, without taking them; then starts sending rank 0 two messages of 1 MiB (a request to the
MPI thread, a reply to nothing to the data plane) and kills itself before rank 0 takes them.
Neither those receives nor rank 0's sends of the replies then ever end (Open MPI's
shared-memory transport copies a large message straight out of its sender's memory: "Read -1,
expected 1048576, errno = 3").

    mpirun --enable-recovery -np 1 fanfs mount IMAGE MNT ... : -np 1 python dying_peer.py BASE

With `output` after BASE it joins an output mount's start-up instead (`fanfs output ...
--replicas 2`: it is rank 0's partner and owner) and starts one message of 1 MiB to rank 0's
replicas thread before it kills itself. It writes its pid to BASE/pid first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from hostile_peer import join, wait_for

from fanfs import placement
from fanfs import world as mpi
from fanfs.native import lib
from fanfs.node.transport.inbox import request_header
from fanfs.node.transport.mpi import FIRST_REPLY_TAG, TAG_REQUEST


def output(world: mpi.World, base: Path) -> None:
    """Rank 0's partner in an output mount (fanfs/output/daemon.py's start-up collectives),
    killed while it sends."""
    from fanfs.output.replicas import TAG

    world.allgather(None)  # the paths checked
    world.allgather(("1-0000dead", str(base / "nowhere")))  # its token and DEST
    world.allgather(None)  # mounted
    (base / "pid").write_text(str(os.getpid()))
    wait_for(base / "go")
    send = world.comm.Isend(bytearray(1 << 20), 0, TAG)
    os.kill(os.getpid(), signal.SIGKILL)
    send.Wait()  # (never reached)


def main() -> int:
    base = Path(sys.argv[1])
    world = mpi.World()
    if sys.argv[2:] == ["output"]:
        output(world, base)
        return 1
    c = join(world)
    owners = placement.place(c.part_size, c.part_flags, world.size, 1)
    theirs = [e for e in range(c.n_entries) if c.is_file[e] and 0 in owners[int(c.part[e])]
              and 8 << 10 <= int(c.stored_len[e]) <= 1 << 20]  # fmt: skip
    if not theirs:
        print("dying_peer: rank 0 holds no file of 8 KiB to 1 MiB", file=sys.stderr)
        return 3
    entry = max(theirs, key=lambda e: int(c.stored_len[e]))
    n = int(c.stored_len[entry])
    (base / "pid").write_text(str(os.getpid()))
    wait_for(base / "go")
    asked = [(world.comm, FIRST_REPLY_TAG)]
    world.comm.Send(request_header(entry, 0, n, FIRST_REPLY_TAG), 0, TAG_REQUEST)
    if world.plane_comm is not None:
        ask = np.array([lib.PLANE_MAGIC, entry, n, lib.PLANE_FIRST_TAG], dtype=np.int64)
        world.plane_comm.Send(ask, 0, lib.PLANE_ASK)
        asked.append((world.plane_comm, lib.PLANE_FIRST_TAG))
    deadline = time.monotonic() + 10
    while not all(comm.Iprobe(0, tag) for comm, tag in asked) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(3)  # rank 0's threads back to their long sleeps: they find what follows late
    big = bytearray(1 << 20)
    sends = [world.comm.Isend(big, 0, TAG_REQUEST)]
    if world.plane_comm is not None:
        sends.append(world.plane_comm.Isend(big, 0, lib.PLANE_FIRST_TAG + 7))
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main())
