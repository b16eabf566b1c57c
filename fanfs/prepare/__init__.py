"""`fanfs prepare`: pack a dataset directory into a prepared image, atomically.

Pipeline: walk SRC breadth-first (so each directory's children get contiguous, sorted entry
ids), then read + checksum + compress files in batches on --jobs worker processes in a bounded
window (inline when --jobs is 1), and append each result to the partition with the fewest
stored bytes so far. That greedy choice balances partitions to within one file and spreads
every directory's files over many partitions. Everything is written into a hidden sibling
directory that is renamed to IMAGE only when complete; any failure removes it.

The steps live in modules of their own: `source` (the walk), `dicts` (zstd dictionaries),
`fanout` (worker processes and MPI ranks), `pack` (partitions), `publish` (catalog,
permissions, rename), `interrupt` (signals at safe points). This module runs them in order.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import stat
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanfs import logs
from fanfs.errors import ExitCode, FanfsError, SourceError, UsageError
from fanfs.image import codec, imagedir
from fanfs.prepare.dicts import train_dictionaries
from fanfs.prepare.fanout import TAG_TASK, results, serve_batches, setup
from fanfs.prepare.interrupt import stop
from fanfs.prepare.pack import Packer
from fanfs.prepare.publish import image_readers, publish, write_catalog
from fanfs.prepare.source import PART_TARGET_BYTES, default_partitions, match_globs, walk
from fanfs.progress import Progress, human_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Summary:
    files: int
    dirs: int
    symlinks: int
    skipped: int
    bytes_in: int
    bytes_stored: int
    partitions: int
    seconds: float

    def line(self, image: Path) -> str:
        ratio = self.bytes_in / self.bytes_stored if self.bytes_stored else 1.0
        rate = self.bytes_in / max(self.seconds, 1e-9) / 1e6
        return (
            f"prepared {image}: {self.files} files, {self.dirs} directories, "
            f"{self.symlinks} symlinks, {human_bytes(self.bytes_in)} in, "
            f"{human_bytes(self.bytes_stored)} stored (ratio {ratio:.2f}), "
            f"{self.partitions} partitions, {self.seconds:.1f} s, {rate:.0f} MB/s"
        )


def prepare(
    src: Path,
    image: Path,
    *,
    partitions: int | None = None,
    compress: str = "auto",
    jobs: int | None = None,
    force: bool = False,
    broadcast: Sequence[str] = (),
    mode: str = "auto",
) -> Summary | None:
    """Prepare IMAGE from SRC. Under an MPI launcher with several ranks, rank 0 walks, packs
    and writes while every rank reads and compresses; ranks other than 0 return None.
    `mode`: who may read the image, "auto" (as private as SRC's most private file) or a name
    of `imagedir.MODES`."""
    if mode != "auto" and mode not in imagedir.MODES:
        raise UsageError(f"--mode: {mode!r} is not auto, {', '.join(imagedir.MODES)}")
    policy = codec.parse_compress(compress)
    jobs = jobs or min(8, os.cpu_count() or 1)
    world = _world()
    if world is not None:
        logs.set_rank(world.rank, world.size)
    if world is not None and world.rank > 0:
        with stop.installed():
            serve_batches(world, jobs)
        world.finalize()
        return None
    state = {"ranks_told": False}
    try:
        image = image.absolute()
        src = src.absolute()
        if not image.parent.is_dir():
            raise SourceError(f"{image.parent}: no such directory")
        imagedir.check_nesting(src, image)
        imagedir.check_replaceable(image, force)
        imagedir.sweep(image)
        with stop.installed():
            summary = _prepare(
                src, image, partitions, policy, jobs, broadcast, world, state, mode, force
            )
    except BaseException as e:
        if world is None:
            raise
        if state["ranks_told"]:
            _abort(world, e)  # other ranks may be blocked on us: end the whole job
        world.bcast(None)  # they wait for the setup: tell them there is nothing to do
        world.finalize()
        raise
    if world is not None:
        world.finalize()
    return summary


def _world() -> Any:
    """The MPI world when launched with several ranks, else None (no MPI initialised)."""
    from fanfs import world as mpi

    return mpi.World() if mpi.launched_size(dict(os.environ)) > 1 else None


def _abort(world: Any, error: BaseException) -> None:
    """Report rank 0's failure the way `fanfs` always does, then end every rank (the image
    directory is already cleaned up): MPI_Abort, and, for launchers that let ranks outlive it
    (mpirun --enable-recovery), a message telling each rank to exit."""
    if isinstance(error, KeyboardInterrupt):
        code = int(ExitCode.INTERRUPTED)
        print("fanfs: interrupted", file=sys.stderr, flush=True)
    elif isinstance(error, FanfsError):
        code = int(error.exit_code)
        print(f"fanfs: error: {error}", file=sys.stderr, flush=True)
    else:
        code = int(ExitCode.FAILED)
        traceback.print_exception(error)
    for rank in range(1, world.size):
        world.post(code, rank, TAG_TASK)
    time.sleep(0.2)  # let the small messages leave before the abort
    world.abort(code)


def _prepare(
    src: Path,
    image: Path,
    partitions: int | None,
    policy: codec.Policy,
    jobs: int,
    broadcast: Sequence[str],
    world: Any = None,
    state: dict[str, bool] | None = None,
    mode: str = "auto",
    force: bool = False,
) -> Summary:
    started = time.monotonic()
    log.info("walking %s", src)
    tree = walk(src, imagedir.image_gid(image.parent))
    who = image_readers(tree, mode)
    bcast = match_globs(tree, os.fsencode(src), broadcast)
    bcast_bytes = sum(tree.size[e] for e in bcast)
    total = sum(tree.size[e] for e, _ in tree.files)
    n_parts = partitions or default_partitions(total - bcast_bytes, len(tree.files) - len(bcast))
    n_bcast = min(len(bcast), max(1, math.ceil(bcast_bytes / PART_TARGET_BYTES))) if bcast else 0
    dicts, dict_ids = train_dictionaries(tree, policy, who) if policy.compresses else ([], {})
    encoder = codec.Encoder(policy, dicts)
    if world is not None and state is not None:
        log.info("packing with %d ranks, %d processes each", world.size, jobs)
        world.bcast(setup(policy, dicts))
        state["ranks_told"] = True
    tmp = imagedir.partial_path(image)
    try:
        tmp.mkdir(mode=0o700)  # nobody else reads it while it is built, whatever it holds
        packer = Packer(tmp, n_parts, n_bcast, len(tree.names))
        packer.broadcast = bcast
        progress = Progress("prepare", len(tree.files), total)
        for entry, path, size, result in results(tree, encoder, dict_ids, jobs, world):
            if result is None:
                packer.add_stream(entry, path, size, encoder)
            else:
                packer.add(entry, *result)
            progress.update(1, size)
            stop.check()
        packer.close()
        write_catalog(tmp, tree, packer, encoder, src)
        stop.check()  # the last moment an interrupt can still leave nothing behind
        publish(tmp, image, who, mode == "auto", force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own mkdtemp-like directory, nobody else's
        raise
    progress.close()
    return Summary(
        files=len(tree.files),
        dirs=sum(1 for m in tree.mode if stat.S_ISDIR(m)),
        symlinks=len(tree.links),
        skipped=tree.skipped,
        bytes_in=total,
        bytes_stored=int(packer.part_size.sum()),
        partitions=n_parts + n_bcast,
        seconds=time.monotonic() - started,
    )


def main_summary(summary: Summary, image: Path) -> None:
    if summary.skipped:
        log.warning("skipped %d special files (sockets, fifos, devices)", summary.skipped)
    print(summary.line(image), file=sys.stdout, flush=True)
