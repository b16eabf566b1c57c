"""The output wing's object graph, built in one place: each part handed what it uses, in order.

Read top to bottom, `build` is the output daemon (as node/assemble.py is the dataset
daemon): the namespace over the staging directory (`Tree`), the partner's copies under MPI
with `--replicas 2` (`Replicas`), the journal and its file on the node, the lander that lands
it at DEST, the view that every request reaches, the front's C threads, and the pyfuse3
adapter in front. Nothing is attached to any object after it is built.

The one loop: the view enqueues puts and waits for landings (it is handed the lander), and
the lander tells the view what landed, failed or was skipped (and the replicas what they may
let go). So the lander's hooks are built before the view and reach it through `outcomes`, a
local of `build` bound once the view exists; they run only from the lander's task, which
starts after `build` returns.

`report` gathers every part's statistics into the one status record (`OutputStatus`) that
`fanfs status` and `fanfs sync` read from the mount.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fanfs.errors import FanfsError
from fanfs.node import fuse_ops
from fanfs.node.staging import StagingDir
from fanfs.output import fs
from fanfs.output.dest import Dest, Result
from fanfs.output.front import FrontInfo, WriteFront, kept_places
from fanfs.output.held import MAX_HELD
from fanfs.output.journal import Journal, Log, Op
from fanfs.output.lander import Lander, Source
from fanfs.output.recover import Dead
from fanfs.output.replicas import Replicas
from fanfs.output.tree import Tree
from fanfs.output.view import View
from fanfs.world import World


@dataclass(frozen=True)
class Wing:
    """Every part of one output daemon, built by `build`."""

    dest: Dest
    staging: StagingDir
    tree: Tree
    replicas: Replicas | None  # under MPI with --replicas 2
    journal: Journal
    lander: Lander
    view: View
    front: WriteFront
    ops: fs.OutputOperations


@dataclass(frozen=True, slots=True)
class Place:
    """Where one output daemon runs: its rank of `size` (`world`: None alone), its node, its
    mount point and DEST (both expanded), and its name in DEST (temporary names, the
    replicas' marker: pids repeat across nodes)."""

    world: World | None
    rank: int
    size: int
    mountpoint: str
    dest: str
    token: str


def new_token(rank: int) -> str:
    """This daemon's name in DEST (temporary names, the replicas' marker): its rank and 8
    random hex digits (pids repeat across nodes)."""
    return f"{rank}-{secrets.token_hex(4)}"


def owner_place(said: Any, rank: int) -> tuple[str, str]:
    """Rank `rank`'s (token, DEST) as it came (`World.allgather`), checked as data: the token
    names temporary files in DEST (a '/' or '..' in it would reach outside), DEST is where
    this rank lands that one's files if it dies."""
    token, dest = said if isinstance(said, list) and len(said) == 2 else (None, None)
    # (new_token's shape)
    if (isinstance(token, str) and re.fullmatch(rf"{rank}-[0-9a-f]{{8}}", token) is not None
            and isinstance(dest, str) and dest.startswith("/") and "\0" not in dest):  # fmt: skip
        return token, dest
    raise FanfsError(f"rank {rank} sent a token and DEST that are not fanfs's: {said!r:.200}")


def build(stack: contextlib.ExitStack, place: Place, dest: Dest, staging: StagingDir,
          dead: list[Dead], *, replicas: int, peer_timeout: float, max_ops: int,
          status: Callable[[], dict[str, Any]], pretend: int = 0) -> Wing:  # fmt: skip
    """The output daemon at `place`, landing at `dest` what is written into `staging` (and
    first what the daemons in `dead` left there); `replicas`, `peer_timeout`, `max_ops` from
    its OutputConfig (`pretend`: its switches' pretend protocol); `status()` is what the
    mount's status attribute answers. Teardowns go on `stack` as their parts exist."""
    tree = Tree(staging.fd, mode=0o777 & ~_umask())
    view: View | None = None  # bound below, once built (the module docstring's one loop)

    def sent(node: int, data: int, size: int) -> None:
        assert view is not None
        view.sent(node, data, size)

    partner: Replicas | None = None
    on_enqueued: Callable[[Op], None] | None = None
    if replicas > 1:
        assert place.world is not None
        # A start-up collective: each rank learns its owner's token and DEST (which may
        # differ per node: {node}), to land the owner's files there if it dies.
        owner = (place.rank - 1) % place.size
        said = place.world.allgather((place.token, place.dest))[owner]
        owner_token, owner_dest = owner_place(said, owner)
        partner = Replicas(place.world, staging, tree.open_local_or_none, owner_dest,
                           owner_token, peer_timeout, on_sent=sent)  # fmt: skip
        on_enqueued = partner.enqueued
        # No more pending changes than the partner holds for us.
        max_ops = min(max_ops, MAX_HELD)
    journal_log = Log(staging.fd, {
        "dest": place.dest, "token": place.token, "pid": os.getpid(),
        "mountpoint": place.mountpoint, "started": time.time(),
        "replicas": partner is not None})  # fmt: skip
    stack.callback(journal_log.close)
    journal = Journal(journal_log, max_ops, on_enqueued)

    def landed(op: Op, result: Result) -> None:
        assert view is not None
        view.landed(op, result)
        if partner is not None:
            partner.landed(op)

    def dropped(op: Op) -> None:
        assert view is not None
        view.dropped(op)

    def skipped(op: Op) -> None:
        assert view is not None
        view.skipped(op)

    def dir_time(path: bytes) -> tuple[int, int] | None:
        assert view is not None
        return view.dir_time(path)

    own = Source("this mount", place.token, tree.open_local_or_none, journal.note)
    lander = Lander(dest, journal, own, recovering=dead, marker=partner is not None,
                    on_landed=landed, on_dropped=dropped, on_skipped=skipped,
                    dir_time=dir_time)  # fmt: skip
    front = WriteFront(fuse_ops.RECEIVER, kept_places(staging.fd, staging.path), staging.path,
                       pretend)  # fmt: skip
    view = View(tree, journal, lander, dest, front=front,
                replicate=partner.replicate if partner is not None else None)  # fmt: skip
    ops = fs.OutputOperations(view, status)
    return Wing(dest, staging, tree, partner, journal, lander, view, front, ops)


@dataclass(frozen=True, slots=True)
class OutputStatus:
    """What an output daemon reports (`fanfs status`, `fanfs sync`): its own facts, then
    every part's statistics."""

    pid: int
    rank: int
    size: int
    node: str
    mountpoint: str
    dest: str
    serving: bool
    phase: str  # starting, serving, draining, closing
    staging: str
    uptime_s: float
    files: int
    written_bytes: int  # through the view and the front
    front: FrontInfo
    view: dict[str, Any]  # View.statistics(): handles, failed writes, evictions
    landing: dict[str, Any]  # Lander.statistics()
    replicas: dict[str, Any] | None  # Replicas.statistics(), with --replicas 2

    def to_json(self) -> dict[str, Any]:
        out = {
            "kind": "output", "pid": self.pid, "rank": self.rank, "size": self.size,
            "node": self.node, "mountpoint": self.mountpoint, "dest": self.dest,
            "serving": self.serving, "phase": self.phase, "staging": self.staging,
            "uptime_s": self.uptime_s, "files": self.files,
            "written_bytes": self.written_bytes, "front": self.front.to_json(),
            **self.view, "landing": self.landing,
        }  # fmt: skip
        if self.replicas is not None:
            out["replicas"] = self.replicas
        return out


def report(wing: Wing, *, rank: int, size: int, node: str, mountpoint: str, dest: str,
           phase: str, started: float) -> OutputStatus:  # fmt: skip
    return OutputStatus(
        pid=os.getpid(), rank=rank, size=size, node=node, mountpoint=mountpoint,
        dest=dest, serving=phase == "serving", phase=phase,
        staging=str(wing.staging.path), uptime_s=round(time.time() - started, 1),
        files=wing.tree.files, written_bytes=wing.view.bytes_written + wing.front.written(),
        front=wing.front.statistics(), view=wing.view.statistics(),
        landing=wing.lander.statistics(),
        replicas=wing.replicas.statistics() if wing.replicas is not None else None,
    )  # fmt: skip


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
