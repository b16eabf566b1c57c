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
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

import numpy as np

from fanfs import catalog as cat
from fanfs import codec
from fanfs.errors import FanfsError, ImageExists, SourceError
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

    def add(self, name: bytes, parent: int, st: os.stat_result) -> int:
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


def walk(src: Path) -> Tree:
    """Breadth-first walk of `src`, not following symlinks."""
    root = os.fsencode(src)
    try:
        st = os.stat(root)
    except OSError as e:
        raise SourceError(f"{src}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"{src}: not a directory")
    tree = Tree()
    tree.add(b"", 0, st)
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
            idx = tree.add(entry.name, parent, est)
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


def _read_whole(path: bytes, size: int, codec_id: int, level: int) -> tuple[int, bytes, int]:
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read: {e.strerror}") from None
    if len(data) != size:
        raise SourceError(f"{os.fsdecode(path)}: changed size while preparing")
    used, stored = codec.encode(data, codec_id, level)
    return used, stored, zlib.crc32(stored)


def _copy_stream(path: bytes, size: int, out: BinaryIO) -> int:
    """Copy a big file raw in chunks; return the CRC-32 of what was written."""
    crc = 0
    done = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(STREAM_CHUNK):
                crc = zlib.crc32(chunk, crc)
                out.write(chunk)
                done += len(chunk)
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read: {e.strerror}") from None
    if done != size:
        raise SourceError(f"{os.fsdecode(path)}: changed size while preparing")
    return crc


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

    def _take(self, entry: int, nbytes: int) -> BinaryIO:
        heap = self.bcast_fill if entry in self.broadcast else self.fill
        used, p = heapq.heappop(heap)
        heapq.heappush(heap, (used + nbytes, p))
        self.part[entry] = p
        self.data_off[entry] = used
        self.stored_len[entry] = nbytes
        self.part_size[p] = used + nbytes
        self.part_files[p] += 1
        return self.outs[p]

    def add(self, entry: int, codec_id: int, stored: bytes, crc: int) -> None:
        self._take(entry, len(stored)).write(stored)
        self.codec[entry] = codec_id
        self.crc[entry] = crc

    def add_stream(self, entry: int, path: bytes, size: int) -> None:
        self.crc[entry] = _copy_stream(path, size, self._take(entry, size))

    def close(self) -> None:
        for out in self.outs:
            out.flush()
            os.fsync(out.fileno())
            out.close()


Item = tuple[int, bytes, int]  # (entry, absolute path, size)
Stored = tuple[int, bytes, int]  # (codec, stored bytes, crc)


def _read_batch(items: list[tuple[bytes, int]], codec_id: int, level: int) -> list[Stored]:
    return [_read_whole(path, size, codec_id, level) for path, size in items]


def _batches(tree: Tree) -> Iterator[list[Item]]:
    """Files in walk order, in batches; a file to stream travels alone."""
    batch: list[Item] = []
    nbytes = pbytes = 0
    for entry, path in tree.files:
        size = tree.size[entry]
        if size > STREAM_THRESHOLD:
            if batch:
                yield batch
                batch, nbytes, pbytes = [], 0, 0
            yield [(entry, path, size)]
            continue
        batch.append((entry, path, size))
        nbytes += size
        pbytes += len(path)
        if len(batch) >= BATCH_FILES or nbytes >= BATCH_BYTES or pbytes >= BATCH_PATH_BYTES:
            yield batch
            batch, nbytes, pbytes = [], 0, 0
    if batch:
        yield batch


def _worker_signals() -> None:
    """Workers die quietly on SIGTERM and leave Ctrl-C (sent to the whole process group) to
    the main process, which cleans up and stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _streamed(batch: list[Item]) -> bool:
    return batch[0][2] > STREAM_THRESHOLD


def _worker_main(conn: Connection, codec_id: int, level: int) -> None:
    """A prepare worker: batches in, stored results (or the error) out, until EOF."""
    _worker_signals()
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        if items is None:  # stop: EOF alone is not enough, later workers hold our pipe too
            return
        try:
            conn.send(("ok", _read_batch(items, codec_id, level)))
        except FanfsError as e:
            conn.send(("error", e))
        except Exception as e:  # a bug: report it with its type rather than hang
            conn.send(("error", RuntimeError(f"prepare worker: {e!r}")))


class _Workers:
    """Worker processes fed over one pipe each; batch i goes to worker i % n, so reading the
    workers round-robin returns results in walk order. No background threads: killing the
    workers on an interrupt can never leave anything waiting for them."""

    def __init__(self, n: int, codec_id: int, level: int):
        ctx = mp.get_context("fork")  # workers are our children: we can always stop them
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(theirs, codec_id, level), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

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
    tree: Tree, codec_id: int, level: int, jobs: int
) -> Iterator[tuple[int, bytes, int, Stored | None]]:
    """(entry, path, size, (codec, stored, crc) or None for streamed files), in walk order.

    With jobs > 1, batches go to worker processes (reading, CRC and compression of small files
    is mostly per-file Python work, which threads would serialise on the GIL); results are
    consumed in walk order, so the image is the same for every --jobs.
    """

    def unpack(
        batch: list[Item], stored: list[Stored] | None
    ) -> Iterator[tuple[int, bytes, int, Stored | None]]:
        for i, (entry, path, size) in enumerate(batch):
            yield entry, path, size, None if stored is None else stored[i]

    if jobs == 1:
        for batch in _batches(tree):
            _stop.check()
            if _streamed(batch):
                yield from unpack(batch, None)
            else:
                yield from unpack(
                    batch, _read_batch([(p, n) for _, p, n in batch], codec_id, level)
                )
        return
    workers = _Workers(jobs, codec_id, level)
    pending: deque[tuple[list[Item], int | None, int]] = deque()  # (batch, worker, bytes)
    inflight = 0
    sent = 0
    try:
        for batch in _batches(tree):
            nbytes = 0 if _streamed(batch) else sum(n for _, _, n in batch)
            while pending and (inflight + nbytes > WINDOW_BYTES or len(pending) >= 2 * jobs):
                done, k, held = pending.popleft()
                inflight -= held
                yield from unpack(done, workers.recv(k) if k is not None else None)
            k = None
            if not _streamed(batch):
                k = sent % jobs
                sent += 1
                workers.conns[k].send([(p, n) for _, p, n in batch])
            pending.append((batch, k, nbytes))
            inflight += nbytes
        while pending:
            done, k, _ = pending.popleft()
            yield from unpack(done, workers.recv(k) if k is not None else None)
    except BaseException:
        workers.close(kill=True)
        raise
    workers.close(kill=False)


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


def prepare(
    src: Path,
    image: Path,
    *,
    partitions: int | None = None,
    compress: str = "none",
    jobs: int | None = None,
    force: bool = False,
    broadcast: Sequence[str] = (),
) -> Summary:
    codec_id, level = codec.parse_compress(compress)
    image = image.absolute()
    src = src.absolute()
    if image.exists() and not force:
        raise ImageExists(f"{image}: already exists (use --force to replace it)")
    if image == src or src in image.parents:
        raise SourceError(f"{image}: the image must not be inside the source directory")
    if not image.parent.is_dir():
        raise SourceError(f"{image.parent}: no such directory")
    jobs = jobs or min(8, os.cpu_count() or 1)
    with _stop.installed():
        return _prepare(src, image, partitions, codec_id, level, compress, jobs, broadcast)


def _prepare(
    src: Path,
    image: Path,
    partitions: int | None,
    codec_id: int,
    level: int,
    compress: str,
    jobs: int,
    broadcast: Sequence[str],
) -> Summary:
    started = time.monotonic()
    log.info("walking %s", src)
    tree = walk(src)
    bcast = _match(tree, os.fsencode(src), broadcast)
    bcast_bytes = sum(tree.size[e] for e in bcast)
    total = sum(tree.size[e] for e, _ in tree.files)
    n_parts = partitions or default_partitions(total - bcast_bytes, len(tree.files) - len(bcast))
    n_bcast = min(len(bcast), max(1, math.ceil(bcast_bytes / PART_TARGET_BYTES))) if bcast else 0
    tmp = image.parent / f".{image.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir()
        packer = _Packer(tmp, n_parts, n_bcast, len(tree.names))
        packer.broadcast = bcast
        progress = Progress("prepare", len(tree.files), total)
        for entry, path, size, result in _results(tree, codec_id, level, jobs):
            if result is None:
                packer.add_stream(entry, path, size)
            else:
                packer.add(entry, *result)
            progress.update(1, size)
            _stop.check()
        packer.close()
        _write_catalog(tmp, tree, packer, compress, src)
        _stop.check()  # the last moment an interrupt can still leave nothing behind
        _publish(tmp, image)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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


def _write_catalog(tmp: Path, tree: Tree, packer: _Packer, compress: str, src: Path) -> None:
    strings = bytearray()
    name_off = np.zeros(len(tree.names), dtype=np.uint64)
    for i, name in enumerate(tree.names):
        name_off[i] = len(strings)
        strings += name
    for entry, target in tree.links.items():
        packer.data_off[entry] = len(strings)
        strings += target
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
    }
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": os.fsdecode(src),
        "compress": compress,
        "host": os.uname().nodename,
    }
    with open(tmp / cat.CATALOG_NAME, "wb") as f:
        f.write(cat.encode({k: np.asarray(v) for k, v in columns.items()}, bytes(strings), meta))
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, image: Path) -> None:
    """Rename the finished image into place; an old image (with --force) goes only after."""
    old = None
    if image.exists() or image.is_symlink():
        old = image.parent / f".{image.name}.old-{os.getpid()}"
        image.rename(old)
    tmp.rename(image)
    dir_fd = os.open(image.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


def main_summary(summary: Summary, image: Path) -> None:
    if summary.skipped:
        log.warning("skipped %d special files (sockets, fifos, devices)", summary.skipped)
    print(summary.line(image), file=sys.stdout, flush=True)
