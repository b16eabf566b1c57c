"""A hostile MPI rank for tests/memory/test_memory.py: it joins a fanfs job's start-up like a
daemon, then asks rank 0 for more than any read asks and for replies it never takes.

    mpirun -np 1 fanfs mount IMAGE MNT ... : -np 1 python hostile_peer.py BASE

Steps, each waiting for a file the test writes in BASE: `go` (the test has measured rank 0's
memory), then one request for a whole large raw file (over the daemon's MAX_REQUEST) and
REQUESTS requests of MAX_REQUEST bytes whose replies it does not take; it writes what came
back (each reply's size, from a probe) to BASE/result.json; `done` (the test has measured
again): it takes the pending replies, then sends batch requests (`batches`: malformed ones, one
over MAX_REQUEST, one naming no file, one of small files) and writes what came back to
BASE/batches.json; then asks on the data plane's communicator (`plane`: malformed asks, a
reply nobody asked for, asks to refuse, a good one) and writes what came back to
BASE/plane.json; then leaves a message on the MPI thread's communicator with a tag that
thread never takes (`stray`), and once the test has measured rank 0 again (`bye`), says bye
and leaves the job cleanly.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fanfs import placement
from fanfs import world as mpi
from fanfs.image import catalog as cat
from fanfs.image.checksum import crc32
from fanfs.native import lib
from fanfs.node.transport.inbox import (
    BATCH_HEADER,
    BATCH_MAX,
    TAG_BATCH,
    batch_header,
    request_header,
)
from fanfs.node.transport.mpi import FIRST_REPLY_TAG, MAX_REQUEST, TAG_BYE, TAG_REQUEST

REQUESTS = 10
STRAY_TAG = 9  # a tag rank 0's MPI thread never takes (fanfs/node/transport/inbox.py)


def publish(path: Path, what: object) -> None:
    """Write `what` to `path` as JSON, whole (the test reads it as soon as the name exists)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(what))
    part.replace(path)


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.05)


def reply(world: mpi.World, tag: int, timeout: float = 30, comm: Any = None) -> bytes | None:
    """Rank 0's reply on `tag` (on `comm`, else the transport's), or None if none came within
    `timeout`."""
    comm, MPI = comm or world.comm, world.MPI
    status = MPI.Status()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if comm.Iprobe(0, tag, status):
            buf = bytearray(max(1, status.Get_count(MPI.BYTE)))
            comm.Recv([buf, status.Get_count(MPI.BYTE), MPI.BYTE], 0, tag)
            return bytes(buf[: status.Get_count(MPI.BYTE)])
        time.sleep(0.01)
    return None


def batches(world: mpi.World, c: cat.Catalog, big: int, small: list[int]) -> dict[str, object]:
    """Batch requests a well-behaved requester never sends, then a good one."""
    comm = world.comm
    tag = FIRST_REPLY_TAG + 100
    bad = batch_header(tag, [small[0]])
    bad[1] = BATCH_MAX + 1  # more files than a batch names
    comm.Send(bad, 0, TAG_BATCH)
    comm.Send(batch_header(tag, [small[0]])[: BATCH_HEADER - 1], 0, TAG_BATCH)  # short
    comm.Send(batch_header(tag + 1, [small[0], big]), 0, TAG_BATCH)  # over MAX_REQUEST
    comm.Send(batch_header(tag + 2, [small[0], 1 << 40]), 0, TAG_BATCH)  # no such entry
    asked = (small * BATCH_MAX)[:BATCH_MAX]
    comm.Send(batch_header(tag + 3, asked), 0, TAG_BATCH)
    got = [reply(world, tag + k, 2 if k == 0 else 30) for k in range(4)]
    good = got[3] or b""
    crcs, at = [], 0
    for e in asked:
        n = int(c.stored_len[e])
        crcs.append(crc32(good[at : at + n]) == int(c.crc[e]))
        at += n
    size = [None if g is None else len(g) for g in got]
    return {"malformed_reply": got[0] is not None, "too_large": size[1], "no_file": size[2],
            "good_size": len(good), "expected_size": at, "good_crcs": all(crcs)}  # fmt: skip


def plane(world: mpi.World, c: cat.Catalog, small: list[int]) -> dict[str, object]:
    """Asks on the data plane's communicator that a well-behaved daemon never sends, a reply
    nobody asked for, asks to refuse, then a good one."""
    comm = world.plane_comm
    if comm is None:
        return {"plane": False}
    e, n = small[0], int(c.stored_len[small[0]])
    tag = lib.PLANE_FIRST_TAG + 200

    def ask(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    comm.Send(ask(lib.PLANE_MAGIC ^ 1, e, n, tag), 0, lib.PLANE_ASK)  # not our magic
    comm.Send(ask(lib.PLANE_MAGIC, e, n)[:3], 0, lib.PLANE_ASK)  # short
    comm.Send(ask(lib.PLANE_MAGIC, e, n, 3), 0, lib.PLANE_ASK)  # no reply tag
    comm.Send(bytearray(1000), 0, lib.PLANE_FIRST_TAG + 5)  # a reply to nothing
    comm.Send(ask(lib.PLANE_MAGIC, e, n + 1, tag + 1), 0, lib.PLANE_ASK)  # not its length
    comm.Send(ask(lib.PLANE_MAGIC, 1 << 40, n, tag + 2), 0, lib.PLANE_ASK)  # no such entry
    comm.Send(ask(lib.PLANE_MAGIC, e, 1 << 40, tag + 3), 0, lib.PLANE_ASK)  # never asked: dropped
    comm.Send(ask(lib.PLANE_MAGIC, e, n, tag + 4), 0, lib.PLANE_ASK)
    got = [reply(world, tag + k, 2 if k == 0 else 30, comm) for k in range(5)]
    good = got[4] or b""
    return {"plane": True, "malformed_reply": got[0] is not None,
            "answered": [None if g is None else len(g) for g in got[1:4]],
            "good_size": len(good), "expected_size": n,
            "good_crc": crc32(good) == int(c.crc[e])}  # fmt: skip


def join(world: mpi.World) -> cat.Catalog:
    """Take part in the daemons' start-up collectives, in their order (fanfs/node/daemon.py):
    the job's catalog."""
    world.bcast(None)
    c = cat.Catalog.from_bytes(world.bcast_bytes(None))
    world.allgather(None)  # store created
    world.allgather(None)  # mounted
    return c


def main() -> int:
    base = Path(sys.argv[1])
    world = mpi.World()
    c = join(world)
    owners = placement.place(c.part_size, c.part_flags, world.size, 1)
    big = [e for e in range(c.n_entries) if c.is_file[e] and c.codec[e] == cat.CODEC_RAW
           and int(c.stored_len[e]) > 4 * MAX_REQUEST and 0 in owners[int(c.part[e])]]  # fmt: skip
    if not big:
        print("hostile_peer: rank 0 holds no large raw file", file=sys.stderr)
        return 3
    entry, size = big[0], int(c.stored_len[big[0]])
    comm, MPI = world.comm, world.MPI
    wait_for(base / "go")
    tags = list(range(FIRST_REPLY_TAG, FIRST_REPLY_TAG + 1 + REQUESTS))
    asks = [(entry, 0, size)] + [(entry, k * MAX_REQUEST, MAX_REQUEST) for k in range(REQUESTS)]
    for (e, off, n), tag in zip(asks, tags, strict=True):
        comm.Send(request_header(e, off, n, tag), 0, TAG_REQUEST)
    sizes: dict[int, int] = {}
    status = MPI.Status()
    deadline = time.monotonic() + 60
    while len(sizes) < len(tags) and time.monotonic() < deadline:
        for tag in tags:
            if tag not in sizes and comm.Iprobe(0, tag, status):
                sizes[tag] = status.Get_count(MPI.BYTE)
        time.sleep(0.05)
    publish(base / "result.json",
            {"whole": sizes.get(tags[0]), "chunks": [sizes.get(t) for t in tags[1:]]})  # fmt: skip
    wait_for(base / "done")
    for tag in tags:  # take every reply, so that rank 0's sends complete
        if comm.Iprobe(0, tag, status):
            comm.Recv(bytearray(max(1, status.Get_count(MPI.BYTE))), 0, tag)
    time.sleep(2)  # rank 0 sees its sends complete (its idle turns: 100 ms) and releases them
    small = [e for e in range(c.n_entries) if c.is_file[e] and 0 < int(c.stored_len[e]) < 1 << 20
             and 0 in owners[int(c.part[e])]]  # fmt: skip
    got = batches(world, c, entry, small)
    publish(base / "batches.json", {**got, "small": len(small)})
    publish(base / "plane.json", plane(world, c, small))
    comm.Send(bytearray(64), 0, STRAY_TAG)  # never taken: it stays at rank 0 until the end
    (base / "stray").touch()
    wait_for(base / "bye")
    comm.Send(np.array([world.rank], dtype=np.int64), 0, TAG_BYE)
    world.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
