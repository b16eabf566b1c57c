"""Which fanfs modules run for one remote READ: the count docs/architecture.md reports.

Two daemons in one process (the in-process transport stands in for MPI: over MPI, mpi.py and
inbox.py run where inproc.py does here), built as fanfs/node/assemble.py builds them, with a
plan state as the daemon has; rank 0 looks up and reads a small compressed file rank 1 holds,
after one warm-up read of another file of the same partition (a steady state: its partition
open, the code imported). A profile hook collects the fanfs modules whose functions ran, on
both sides.

    .venv/bin/python tools/read_path.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pyfuse3
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import parts

from fanfs import placement
from fanfs.bench.launch import check
from fanfs.image import catalog as cat
from fanfs.node.fuse_ops import ROOT, FanfsOperations
from fanfs.node.plans import Plans
from fanfs.node.sources import PeerServer
from fanfs.node.store import PartitionStore
from fanfs.node.transport.inproc import Cluster


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="fanfs-read-path-"))
    src = base / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):  # small CSV files: compressed whole, with a dictionary
        rows = b"".join(b"%d,%d\n" % (k, rng.integers(0, 9)) for k in range(4000))
        (src / f"f{i:02d}.csv").write_bytes(rows)
    check("-q", "prepare", src, base / "img", "--partitions", "8")
    c, _ = cat.Catalog.load(base / "img")
    owners = placement.place(c.part_size, c.part_flags, 2, 1)
    stores = [PartitionStore(base / "img", c, base / f"local-{r}", placement.owned_by(owners, r))
              for r in range(2)]  # fmt: skip
    locals_ = [parts.local(c, s, r, owners) for r, s in enumerate(stores)]
    cluster = Cluster([PeerServer(c, loc) for loc in locals_], 5.0)
    reader = parts.reader(c, locals_[0], owners=owners, transport=cluster.ranks[0],
                          plans=Plans(c, 64 << 20))  # fmt: skip
    ops = FanfsOperations(c, reader, lambda: {})
    remote = [e for e, _ in c.walk() if c.is_file[e] and 0 not in owners[int(c.part[e])]]
    first = remote[0]
    second = next(e for e in remote[1:] if int(c.part[e]) == int(c.part[first]))
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if "/fanfs/" in name:
            seen.add(name.split("/fanfs/", 1)[1])

    async def read(entry: int, traced: bool) -> bytes:
        ctx = pyfuse3.RequestContext()
        if traced:
            sys.setprofile(profile)
        await ops.lookup(ROOT, c.name(entry), ctx)
        got = await ops.read(entry + ROOT, 0, int(c.size[entry]))
        sys.setprofile(None)
        return bytes(got)  # type: ignore[arg-type]

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            for t in cluster.ranks:
                await nursery.start(t.run)
            await read(first, traced=False)
            got = await read(second, traced=True)
            assert got == (src / c.name(second).decode()).read_bytes()
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        for s in stores:
            s.close()
    print(f"{len(seen)} modules: {', '.join(sorted(seen))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
