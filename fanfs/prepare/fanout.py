"""Farming the reading, checksumming and compressing of files out to worker processes and MPI
ranks, results consumed in walk order so the image is the same for every --jobs and rank count.

Memory stays bounded: at most WINDOW_BYTES of file data are read ahead of the writer."""

from __future__ import annotations

import base64
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from fanfs.errors import FanfsError
from fanfs.image import codec
from fanfs.prepare.dicts import group
from fanfs.prepare.interrupt import stop
from fanfs.prepare.pack import STREAM_THRESHOLD
from fanfs.prepare.source import Tree, read_file

log = logging.getLogger(__name__)

# Bytes of file data read ahead of the writer: bounds prepare's memory whatever --jobs is.
WINDOW_BYTES = 256 << 20
# Files per task handed to a worker: amortises the hand-off over many small files.
BATCH_FILES = 256
BATCH_BYTES = 8 << 20
# A batch's paths travel to its worker in one message, which must fit the pipe's buffer
# (about 200 KiB) so that sending never waits on a worker that is busy sending a result.
BATCH_PATH_BYTES = 64 << 10


Item = tuple[int, bytes, int, int]  # (entry, absolute path, size, dictionary id or 0)
Stored = tuple[int, bytes, int]  # (codec, stored bytes, crc)
Task = list[tuple[bytes, int, int]]  # what a worker gets: (path, size, dictionary id) per file


def _read_batch(items: Task, encoder: codec.Encoder) -> list[Stored]:
    return [encoder.encode(read_file(path, size), dict_id) for path, size, dict_id in items]


def _task(batch: list[Item]) -> Task:
    return [(p, n, d) for _, p, n, d in batch]


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
        dict_id = dict_ids.get(group(path), 0) if dict_ids and size <= codec.DICT_MAX_FILE else 0
        batch.append((entry, path, size, dict_id))
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
            stop.check()
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


def setup(policy: codec.Policy, dicts: list[bytes]) -> list[Any]:
    """What rank 0 tells the others before packing (`World.bcast`'s JSON: the policy as
    `--compress` spells it, the dictionaries in base64)."""
    return [str(policy), [base64.b64encode(d).decode() for d in dicts]]


def _setup(said: Any) -> codec.Encoder:
    """The encoder `setup` describes, checked as data."""
    spec, dicts = said if isinstance(said, list) and len(said) == 2 else (None, None)
    if isinstance(spec, str) and isinstance(dicts, list):
        try:
            return codec.Encoder(codec.parse_compress(spec),
                                 [base64.b64decode(d, validate=True) for d in dicts])  # fmt: skip
        except (TypeError, ValueError):  # (binascii.Error is one)
            pass
    raise FanfsError(f"rank 0 sent packing settings that are not fanfs's: {said!r:.200}")


def serve_batches(world: Any, jobs: int) -> None:
    """A rank other than 0 under an MPI launcher: read, checksum and compress the batches rank 0
    sends, with `jobs` local processes, and send the results back in order."""
    said = world.bcast(None)
    if said is None:  # rank 0 failed before packing: it reports the error
        return
    encoder = _setup(said)
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
            stop.check()
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


def results(
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
            stop.check()
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


POLL_S = 0.1  # how soon a wait for a worker notices an interrupt (or its death)
RANK_POLL_S = 0.001  # how often rank 0 looks for another rank's result
TAG_TASK, TAG_RESULT = 11, 12
HELPER = "prepare on another rank"
