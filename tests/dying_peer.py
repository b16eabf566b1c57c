"""A rank for tests/mpi/test_mpi.py that dies mid-send: it joins a fanfs job's start-up like a
daemon and, once the test says `go`, starts sending rank 0 two messages of 1 MiB (a request on
the MPI thread's communicator, a reply to nothing on the data plane's) and kills itself before
rank 0 takes them. Their receives then never end (Open MPI's shared-memory transport copies a
large message out of its sender's memory as it is received: "Read -1, expected 1048576,
errno = 3").

    mpirun --enable-recovery -np 1 fanfs mount IMAGE MNT ... : -np 1 python dying_peer.py BASE

It writes its pid to BASE/pid first.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from hostile_peer import join, wait_for

from fanfs import world as mpi
from fanfs.native import lib
from fanfs.node.transport.mpi import TAG_REQUEST


def main() -> int:
    base = Path(sys.argv[1])
    world = mpi.World()
    join(world)
    (base / "pid").write_text(str(os.getpid()))
    wait_for(base / "go")
    big = bytearray(1 << 20)
    sends = [world.comm.Isend(big, 0, TAG_REQUEST)]
    if world.plane_comm is not None:
        sends.append(world.plane_comm.Isend(big, 0, lib.PLANE_FIRST_TAG + 7))
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main())
