"""`fanfs prepare`: pack a dataset directory into a prepared image, atomically.

Pipeline: walk SRC breadth-first (so each directory's children get contiguous, sorted entry
ids), then read + checksum + compress files in batches on --jobs worker processes in a bounded
window (inline when --jobs is 1), and append each result to the partition with the fewest
stored bytes so far. That greedy choice balances partitions to within one file and spreads
every directory's files over many partitions. Everything is written into a hidden sibling
directory that is renamed to IMAGE only when complete; any failure removes it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import heapq
import logging
import math
import multiprocessing as mp
import os
import resource
import shutil
import signal
import stat
import sys
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

import numpy as np
import zstandard

from fanfs import catalog as cat
from fanfs import codec, imagedir, logs
from fanfs.errors import ExitCode, FanfsError, SourceError, UsageError
from fanfs.progress import Progress, human_bytes

log = logging.getLogger(__name__)

# Default partition count: one per 64 MiB stored, at least 16 so that a small dataset still
# spreads over many ranks, at most 1024 so a node never juggles thousands of staged files.
PART_TARGET_BYTES = 64 << 20
MIN_PARTITIONS = 16
MAX_PARTITIONS = 1024
# Files above this are copied raw in chunks instead of being held whole in memory.
STREAM_THRESHOLD = 256 << 20
STREAM_CHUNK = 8 << 20
# Bytes of file data read ahead of the writer: bounds prepare's memory whatever --jobs is.
WINDOW_BYTES = 256 << 20
# Files per task handed to a worker: amortises the hand-off over many small files.
BATCH_FILES = 256
BATCH_BYTES = 8 << 20
# A batch's paths travel to its worker in one message, which must fit the pipe's buffer
# (about 200 KiB) so that sending never waits on a worker that is busy sending a result.
BATCH_PATH_BYTES = 64 << 10
# Dictionaries: one per group of small files (same extension) with enough files to pay for
# it, trained on up to DICT_SAMPLE_FILES files spread over the group (walk order, so the image
# is the same every time), at most DICT_SAMPLE_BYTES of them.
DICT_SIZE = 64 << 10
DICT_MIN_FILES = 64
DICT_SAMPLE_FILES = 2000
DICT_SAMPLE_BYTES = 8 << 20
MAX_DICTS = 64


@dataclass
class Tree:
    """The walked source: catalog columns as Python lists, plus what packing needs."""

    names: list[bytes] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    mode: list[int] = field(default_factory=list)
    mtime_ns: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    child_start: list[int] = field(default_factory=list)
    child_count: list[int] = field(default_factory=list)
    links: dict[int, bytes] = field(default_factory=dict)
    files: list[tuple[int, bytes]] = field(default_factory=list)  # (entry, absolute path)
    skipped: int = 0
    # Who besides the owner can read each entry (imagedir.readers), and the image's group.
    readers: list[int] = field(default_factory=list)
    image_gid: int | None = None

    def add(self, name: bytes, parent: int, st: os.stat_result, above: int) -> int:
        self.readers.append(imagedir.readers(st, self.image_gid, above))
        self.names.append(name)
        self.parent.append(parent)
        self.mode.append(st.st_mode)
        self.mtime_ns.append(st.st_mtime_ns)
        self.size.append(st.st_size)
        self.child_start.append(0)
        self.child_count.append(0)
        return len(self.names) - 1


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


def _scan(path: bytes) -> list[os.DirEntry[bytes]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read directory: {e.strerror}") from None


def walk(src: Path, image_gid: int | None = None) -> Tree:
    """Breadth-first walk of `src`, not following symlinks."""
    root = os.fsencode(src)
    try:
        st = os.stat(root)
    except OSError as e:
        raise SourceError(f"{src}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"{src}: not a directory")
    tree = Tree(image_gid=image_gid)
    tree.add(b"", 0, st, imagedir.reach(src, image_gid))
    queue: deque[tuple[int, bytes]] = deque([(0, root)])
    while queue:
        _stop.check()
        parent, path = queue.popleft()
        tree.child_start[parent] = len(tree.names)
        for entry in _scan(path):
            full = os.path.join(path, entry.name)
            try:
                est = entry.stat(follow_symlinks=False)
                target = os.readlink(full) if stat.S_ISLNK(est.st_mode) else None
            except OSError as e:
                raise SourceError(f"{os.fsdecode(full)}: {e.strerror}") from None
            fmt = stat.S_IFMT(est.st_mode)
            if fmt not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
                log.warning("skipping %s: not a file, directory or symlink", os.fsdecode(full))
                tree.skipped += 1
                continue
            idx = tree.add(entry.name, parent, est, tree.readers[parent])
            if fmt == stat.S_IFDIR:
                queue.append((idx, full))
            elif fmt == stat.S_IFREG:
                tree.files.append((idx, full))
            else:
                assert target is not None
                tree.links[idx] = target
                tree.size[idx] = len(target)
        tree.child_count[parent] = len(tree.names) - tree.child_start[parent]
    return tree


def _match(tree: Tree, root: bytes, globs: Sequence[str]) -> set[int]:
    """Entries of the files whose path relative to SRC matches a glob (`*` crosses `/`)."""
    if not globs:
        return set()
    cut = len(root) + 1
    return {
        entry
        for entry, path in tree.files
        if any(fnmatch.fnmatchcase(os.fsdecode(path[cut:]), g) for g in globs)
    }


def default_partitions(total_bytes: int, n_files: int) -> int:
    wanted = math.ceil(total_bytes / PART_TARGET_BYTES)
    return max(1, min(max(MIN_PARTITIONS, min(wanted, MAX_PARTITIONS)), n_files))


def _read(path: bytes, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read: {e.strerror}") from None
    if len(data) != size:
        raise SourceError(f"{os.fsdecode(path)}: changed size while preparing")
    return data


def _copy_stream(path: bytes, size: int, out: BinaryIO, encoder: codec.Encoder) -> tuple[int, int]:
    """Store a big file chunk by chunk, never whole in memory: raw, or framed when the policy
    frames it. Returns (codec, CRC-32 for the catalog)."""
    framed = encoder.framed(size)
    chunk_size = encoder.frame_size if framed else STREAM_CHUNK
    frames: codec.FrameWriter | None = None
    crc = 0
    done = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                if framed and frames is None:
                    skip = encoder.policy.mode == "auto" and codec.already_compressed(chunk[:16])
                    frames = codec.FrameWriter(encoder, skip)
                if frames is not None:
                    out.write(frames.add(chunk))
                else:
                    crc = zlib.crc32(chunk, crc)
                    out.write(chunk)
                done += len(chunk)
                if done > size:
                    break
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read: {e.strerror}") from None
    if done != size:
        raise SourceError(f"{os.fsdecode(path)}: changed size while preparing")
    if frames is None:
        return cat.CODEC_RAW, crc
    table = frames.table()
    out.write(table)
    return cat.CODEC_FRAMED, zlib.crc32(table)


class _Packer:
    """Appends stored files to the least-filled partition of their set (normal or broadcast).

    Partitions 0..n_parts-1 are normal; the n_bcast after them hold the broadcast set.
    """

    def __init__(self, tmp: Path, n_parts: int, n_bcast: int, n_entries: int):
        total = n_parts + n_bcast
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < total + 64 <= hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (total + 64, hard))
        self.outs = [open(tmp / cat.partition_name(p), "wb") for p in range(total)]  # noqa: SIM115
        # heaps of (stored bytes, partition), one per set
        self.fill = [(0, p) for p in range(n_parts)]
        self.bcast_fill = [(0, p) for p in range(n_parts, total)]
        self.part_flags = np.zeros(total, dtype=np.uint32)
        self.part_flags[n_parts:] = cat.PART_BROADCAST
        self.broadcast: set[int] = set()
        n_parts = total
        self.part_size = np.zeros(n_parts, dtype=np.uint64)
        self.part_files = np.zeros(n_parts, dtype=np.uint64)
        self.part = np.full(n_entries, cat.NO_PARTITION, dtype=np.uint32)
        self.data_off = np.zeros(n_entries, dtype=np.uint64)
        self.stored_len = np.zeros(n_entries, dtype=np.uint64)
        self.crc = np.zeros(n_entries, dtype=np.uint32)
        self.codec = np.zeros(n_entries, dtype=np.uint8)

    def _least_filled(self, entry: int) -> list[tuple[int, int]]:
        return self.bcast_fill if entry in self.broadcast else self.fill

    def _record(self, entry: int, nbytes: int) -> None:
        """`entry`'s nbytes were just appended to the least-filled partition of its set."""
        heap = self._least_filled(entry)
        used, p = heap[0]
        heapq.heapreplace(heap, (used + nbytes, p))
        self.part[entry] = p
        self.data_off[entry] = used
        self.stored_len[entry] = nbytes
        self.part_size[p] = used + nbytes
        self.part_files[p] += 1

    def add(self, entry: int, codec_id: int, stored: bytes, crc: int) -> None:
        self.outs[self._least_filled(entry)[0][1]].write(stored)
        self._record(entry, len(stored))
        self.codec[entry] = codec_id
        self.crc[entry] = crc

    def add_stream(self, entry: int, path: bytes, size: int, encoder: codec.Encoder) -> None:
        out = self.outs[self._least_filled(entry)[0][1]]
        start = out.tell()
        self.codec[entry], self.crc[entry] = _copy_stream(path, size, out, encoder)
        self._record(entry, out.tell() - start)

    def close(self) -> None:
        for out in self.outs:
            out.flush()
            os.fsync(out.fileno())
            out.close()


Item = tuple[int, bytes, int, int]  # (entry, absolute path, size, dictionary id or 0)
Stored = tuple[int, bytes, int]  # (codec, stored bytes, crc)
Task = list[tuple[bytes, int, int]]  # what a worker gets: (path, size, dictionary id) per file


def _read_batch(items: Task, encoder: codec.Encoder) -> list[Stored]:
    return [encoder.encode(_read(path, size), dict_id) for path, size, dict_id in items]


def _task(batch: list[Item]) -> Task:
    return [(p, n, d) for _, p, n, d in batch]


def _group(path: bytes) -> bytes:
    """Which files share a dictionary: those with the same extension (case folded)."""
    return cat.extension(path.rsplit(b"/", 1)[-1])


def _batches(tree: Tree, dict_ids: dict[bytes, int]) -> Iterator[list[Item]]:
    """Files in walk order, in batches; a file to stream travels alone."""
    batch: list[Item] = []
    nbytes = pbytes = 0
    for entry, path in tree.files:
        size = tree.size[entry]
        if size > STREAM_THRESHOLD:
            if batch:
                yield batch
                batch, nbytes, pbytes = [], 0, 0
            yield [(entry, path, size, 0)]
            continue
        dict_id = dict_ids.get(_group(path), 0) if dict_ids and size <= codec.DICT_MAX_FILE else 0
        batch.append((entry, path, size, dict_id))
        nbytes += size
        pbytes += len(path)
        if len(batch) >= BATCH_FILES or nbytes >= BATCH_BYTES or pbytes >= BATCH_PATH_BYTES:
            yield batch
            batch, nbytes, pbytes = [], 0, 0
    if batch:
        yield batch


def train_dictionaries(
    tree: Tree, policy: codec.Policy, who: int = imagedir.EVERYONE
) -> tuple[list[bytes], dict[bytes, int]]:
    """Dictionaries for the groups of small files, and which group uses which (id = index + 1).

    A dictionary holds pieces of its samples and goes into the catalog, which every reader of
    the image can read: a file that fewer users may read than `who` (the image's readers) is
    never a sample."""
    groups: dict[bytes, list[tuple[bytes, int]]] = {}
    for entry, path in tree.files:
        size = tree.size[entry]
        if 0 < size <= codec.DICT_MAX_FILE and tree.readers[entry] & who == who:
            groups.setdefault(_group(path), []).append((path, size))
    ranked = sorted(
        ((sum(n for _, n in files), key, files) for key, files in groups.items()
         if len(files) >= DICT_MIN_FILES),
        key=lambda g: (-g[0], g[1]),
    )  # fmt: skip
    dicts: list[bytes] = []
    ids: dict[bytes, int] = {}
    for _, key, files in ranked[:MAX_DICTS]:
        _stop.check()
        samples: list[bytes] = []
        taken = 0
        for path, size in files[:: max(1, len(files) // DICT_SAMPLE_FILES)]:
            if taken + size > DICT_SAMPLE_BYTES:
                break
            samples.append(_read(path, size))
            taken += size
        if policy.mode == "auto":
            packed = sum(codec.already_compressed(x[:16]) for x in samples)
            if packed * 2 > len(samples):
                log.info("no dictionary for %r files: compressed already", os.fsdecode(key))
                continue
        pool: list[bytes | bytearray | memoryview] = list(samples)
        try:
            trained = zstandard.train_dictionary(
                min(DICT_SIZE, taken // 8), pool, dict_id=len(dicts) + 1, level=policy.level
            )
        except zstandard.ZstdError as e:  # too few or too uniform samples: no dictionary
            log.info("no dictionary for %r files: %s", os.fsdecode(key), e)
            continue
        dicts.append(trained.as_bytes())
        ids[key] = len(dicts)
    if dicts:
        names = ", ".join(repr(os.fsdecode(k) or "(no extension)") for k in ids)
        log.info("trained %d dictionaries (%s)", len(dicts), names)
    return dicts, ids


def _worker_signals() -> None:
    """Workers die quietly on SIGTERM and leave Ctrl-C (sent to the whole process group) to
    the main process, which cleans up and stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _streamed(batch: list[Item]) -> bool:
    return batch[0][2] > STREAM_THRESHOLD


def _worker_main(conn: Connection, encoder: codec.Encoder) -> None:
    """A prepare worker: batches in, stored results (or the error) out, until EOF."""
    _worker_signals()
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        if items is None:  # stop: EOF alone is not enough, later workers hold our pipe too
            return
        conn.send(_outcome("prepare worker", _read_batch, items, encoder))


class _Ranks:
    """The other MPI ranks as workers: batch in, results out in the order sent, each rank
    spreading its batches over its own --jobs processes (`serve_batches`)."""

    def __init__(self, world: Any):
        self.world = world

    def send(self, rank: int, task: Task) -> None:
        self.world.post(task, rank, TAG_TASK)

    def recv(self, rank: int) -> list[Stored]:
        while not self.world.pending(rank, TAG_RESULT):
            _stop.check()
            time.sleep(RANK_POLL_S)
        kind, payload = self.world.recv(rank, TAG_RESULT)
        if kind == "error":
            raise payload
        return payload  # type: ignore[no-any-return]

    def close(self) -> None:
        for rank in range(1, self.world.size):
            self.world.post(None, rank, TAG_TASK)
        self.world.drain()


def _outcome(where: str, fn: Any, *args: Any) -> tuple[str, Any]:
    """("ok", fn(*args)), or ("error", exception) to send to whoever waits for the result."""
    try:
        return "ok", fn(*args)
    except FanfsError as e:
        return "error", e
    except Exception as e:  # a bug: report it with its type rather than hang the waiter
        return "error", RuntimeError(f"{where}: {e!r}")


def serve_batches(world: Any, jobs: int) -> None:
    """A rank other than 0 under an MPI launcher: read, checksum and compress the batches rank 0
    sends, with `jobs` local processes, and send the results back in order."""
    setup = world.bcast(None)
    if setup is None:  # rank 0 failed before packing: it reports the error
        return
    mode, level, dicts = setup
    encoder = codec.Encoder(codec.Policy(mode, level), dicts)
    workers = _Workers(jobs, encoder) if jobs > 1 else None
    inflight: deque[int] = deque()
    sent = files = 0
    try:
        while True:
            if inflight and not world.pending(0, TAG_TASK):
                assert workers is not None
                world.post(_outcome(HELPER, workers.recv, inflight.popleft()), 0, TAG_RESULT)
                continue
            task = world.recv(0, TAG_TASK)
            if task is None:
                break
            if isinstance(task, int):  # rank 0 failed: its exit code
                if workers is not None:
                    workers.close(kill=True)
                os._exit(task)  # posted sends may never complete: no drain, no finalize
            files += len(task)
            if workers is None:
                world.post(_outcome(HELPER, _read_batch, task, encoder), 0, TAG_RESULT)
            else:
                workers.send(sent % jobs, task)
                inflight.append(sent % jobs)
                sent += 1
        world.drain()
        log.info("rank %d: read and compressed %d files", world.rank, files)
    finally:
        if workers is not None:
            workers.close(kill=True)


class _Workers:
    """Worker processes fed over one pipe each; batch i goes to worker i % n, so reading the
    workers round-robin returns results in walk order. No background threads: killing the
    workers on an interrupt can never leave anything waiting for them."""

    def __init__(self, n: int, encoder: codec.Encoder):
        ctx = mp.get_context("fork")  # workers are our children: we can always stop them
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(theirs, encoder), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def send(self, k: int, task: Task) -> None:
        self.conns[k].send(task)

    def recv(self, k: int) -> list[Stored]:
        while not self.conns[k].poll(POLL_S):
            _stop.check()
            if not self.procs[k].is_alive():
                raise RuntimeError("a prepare worker died")
        kind, payload = self.conns[k].recv()
        if kind == "error":
            raise payload
        return payload  # type: ignore[no-any-return]

    def close(self, kill: bool) -> None:
        for conn in self.conns:
            if not kill:
                conn.send(None)  # finish: each worker was forked holding the earlier pipes too
            conn.close()
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(10)


def _results(
    tree: Tree, encoder: codec.Encoder, dict_ids: dict[bytes, int], jobs: int, world: Any = None
) -> Iterator[tuple[int, bytes, int, Stored | None]]:
    """(entry, path, size, (codec, stored, crc) or None for streamed files), in walk order.

    With jobs > 1, batches go to worker processes (reading, CRC and compression of small files
    is mostly per-file Python work, which threads would serialise on the GIL). Under an MPI
    launcher the other ranks work too, `jobs` batches in flight each. Batches go round-robin to
    the lanes (local workers and ranks) and results are consumed in walk order, so the image is
    the same for every --jobs and rank count.
    """

    def unpack(
        batch: list[Item], stored: list[Stored] | None
    ) -> Iterator[tuple[int, bytes, int, Stored | None]]:
        for i, (entry, path, size, _) in enumerate(batch):
            yield entry, path, size, None if stored is None else stored[i]

    if jobs == 1 and world is None:
        for batch in _batches(tree, dict_ids):
            _stop.check()
            yield from unpack(
                batch, None if _streamed(batch) else _read_batch(_task(batch), encoder)
            )
        return
    workers = _Workers(jobs, encoder) if jobs > 1 else None
    ranks = _Ranks(world) if world is not None else None
    lanes: list[tuple[Any, int]] = []
    for k in range(jobs):
        if workers is not None:
            lanes.append((workers, k))
        if ranks is not None:
            lanes += [(ranks, r) for r in range(1, world.size)]
    pending: deque[tuple[list[Item], int | None, int]] = deque()  # (batch, lane, bytes)
    inflight = 0
    sent = 0

    def result(lane: int | None) -> list[Stored] | None:
        if lane is None:
            return None
        source, k = lanes[lane]
        return source.recv(k)  # type: ignore[no-any-return]

    try:
        for batch in _batches(tree, dict_ids):
            nbytes = 0 if _streamed(batch) else sum(n for _, _, n, _ in batch)
            while pending and (inflight + nbytes > WINDOW_BYTES or len(pending) >= 2 * len(lanes)):
                done, lane, held = pending.popleft()
                inflight -= held
                yield from unpack(done, result(lane))
            lane = None
            if not _streamed(batch):
                lane = sent % len(lanes)
                sent += 1
                source, k = lanes[lane]
                source.send(k, _task(batch))
            pending.append((batch, lane, nbytes))
            inflight += nbytes
        while pending:
            done, lane, _ = pending.popleft()
            yield from unpack(done, result(lane))
    except BaseException:
        if workers is not None:
            workers.close(kill=True)
        raise  # ranks: the caller aborts the job (they may be busy sending to us)
    if workers is not None:
        workers.close(kill=False)
    if ranks is not None:
        ranks.close()


class _Interrupt:
    """SIGINT/SIGTERM during prepare, delivered only at safe points.

    Raising from the signal handler itself is not safe: the exception can surface inside code
    that swallows it (an at-fork hook of the logging module did, and prepare then finished
    instead of stopping). The handler only records the signal; the loops call `check`.
    """

    def __init__(self) -> None:
        self._hit = threading.Event()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._hit.set()

    def check(self) -> None:
        if self._hit.is_set():
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self._hit.clear()
        previous = {s: signal.signal(s, self._record) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


_stop = _Interrupt()
POLL_S = 0.1  # how soon a wait for a worker notices an interrupt (or its death)
RANK_POLL_S = 0.001  # how often rank 0 looks for another rank's result
TAG_TASK, TAG_RESULT = 11, 12
HELPER = "prepare on another rank"


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
        with _stop.installed():
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
        with _stop.installed():
            summary = _prepare(src, image, partitions, policy, jobs, broadcast, world, state, mode)
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
    from fanfs.transport import mpi

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
) -> Summary:
    started = time.monotonic()
    log.info("walking %s", src)
    tree = walk(src, imagedir.image_gid(image.parent))
    who = _image_readers(tree, mode)
    bcast = _match(tree, os.fsencode(src), broadcast)
    bcast_bytes = sum(tree.size[e] for e in bcast)
    total = sum(tree.size[e] for e, _ in tree.files)
    n_parts = partitions or default_partitions(total - bcast_bytes, len(tree.files) - len(bcast))
    n_bcast = min(len(bcast), max(1, math.ceil(bcast_bytes / PART_TARGET_BYTES))) if bcast else 0
    dicts, dict_ids = train_dictionaries(tree, policy, who) if policy.compresses else ([], {})
    encoder = codec.Encoder(policy, dicts)
    if world is not None and state is not None:
        log.info("packing with %d ranks, %d processes each", world.size, jobs)
        world.bcast((policy.mode, policy.level, dicts))
        state["ranks_told"] = True
    tmp = imagedir.partial_path(image)
    try:
        tmp.mkdir(mode=0o700)  # nobody else reads it while it is built, whatever it holds
        packer = _Packer(tmp, n_parts, n_bcast, len(tree.names))
        packer.broadcast = bcast
        progress = Progress("prepare", len(tree.files), total)
        for entry, path, size, result in _results(tree, encoder, dict_ids, jobs, world):
            if result is None:
                packer.add_stream(entry, path, size, encoder)
            else:
                packer.add(entry, *result)
            progress.update(1, size)
            _stop.check()
        packer.close()
        _write_catalog(tmp, tree, packer, encoder, src)
        _stop.check()  # the last moment an interrupt can still leave nothing behind
        _publish(tmp, image, who, mode == "auto")
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


def _write_catalog(
    tmp: Path, tree: Tree, packer: _Packer, encoder: codec.Encoder, src: Path
) -> None:
    strings = bytearray()
    name_off = np.zeros(len(tree.names), dtype=np.uint64)
    for i, name in enumerate(tree.names):
        name_off[i] = len(strings)
        strings += name
    for entry, target in tree.links.items():
        packer.data_off[entry] = len(strings)
        strings += target
    dict_off = np.zeros(len(encoder.dicts), dtype=np.uint64)
    for i, d in enumerate(encoder.dicts):
        dict_off[i] = len(strings)
        strings += d
    columns: dict[str, Any] = {
        "parent": tree.parent,
        "mode": tree.mode,
        "mtime_ns": tree.mtime_ns,
        "size": tree.size,
        "name_off": name_off,
        "name_len": [len(n) for n in tree.names],
        "child_start": tree.child_start,
        "child_count": tree.child_count,
        "part": packer.part,
        "data_off": packer.data_off,
        "stored_len": packer.stored_len,
        "crc": packer.crc,
        "codec": packer.codec,
        "part_size": packer.part_size,
        "part_files": packer.part_files,
        "part_flags": packer.part_flags,
        "dict_off": dict_off,
        "dict_len": [len(d) for d in encoder.dicts],
    }
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": os.fsdecode(src),
        "compress": str(encoder.policy),
        "host": os.uname().nodename,
    }
    with open(tmp / cat.CATALOG_NAME, "wb") as f:
        arrays = {k: np.asarray(v) for k, v in columns.items()}
        f.write(cat.encode(arrays, bytes(strings), meta, frame_size=encoder.frame_size))
        f.flush()
        os.fsync(f.fileno())


def _image_readers(tree: Tree, mode: str) -> int:
    """Who may read the image besides its owner (imagedir.GROUP/OTHERS), with a warning
    where SRC holds files that not every user may read."""
    files = [e for e, _ in tree.files]
    private = [e for e in files if tree.readers[e] != imagedir.EVERYONE]
    least = imagedir.EVERYONE
    for e in private:
        least &= tree.readers[e]
    who = least if mode == "auto" else imagedir.MODES[mode]
    if private:
        example = os.fsdecode(tree.files[files.index(private[0])][1])
        exposed = [e for e in private if tree.readers[e] & who != who]
        log.warning(
            "%d of %d files in the source are not readable by every user (e.g. %s); the image "
            "will be readable by %s%s", len(private), len(files), example,
            imagedir.describe(who),
            f": --mode {mode} exposes {len(exposed)} of them" if exposed else
            " (--mode public|group to share it)",
        )  # fmt: skip
    return who


def _publish(tmp: Path, image: Path, who: int, umask: bool) -> None:
    """Give the image its permissions, then rename it into place; an old image (with --force,
    checked to be one) goes only after the new one is in place."""
    dir_mode, file_mode = imagedir.permissions(who)
    if umask:
        mask = imagedir.umask()
        dir_mode, file_mode = dir_mode & ~mask | 0o700, file_mode & ~mask | 0o600
    for name in os.listdir(tmp):
        os.chmod(tmp / name, file_mode, follow_symlinks=False)
    old = None
    if image.exists() or image.is_symlink():
        imagedir.check_replaceable(image, force=True)  # again: it may have changed meanwhile
        old = imagedir.old_path(image)
        image.rename(old)
    os.chmod(tmp, dir_mode)
    tmp.rename(image)
    dir_fd = os.open(image.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if old is not None:
        imagedir.remove(old)


def main_summary(summary: Summary, image: Path) -> None:
    if summary.skipped:
        log.warning("skipped %d special files (sockets, fifos, devices)", summary.skipped)
    print(summary.line(image), file=sys.stdout, flush=True)
