"""Packing stored files into partitions: the least-filled partition of a file's set takes it.

Partitions 0..n-1 are normal; the broadcast set's partitions follow. Greedy least-filled
placement balances partitions to within one file and spreads every directory over all of them.
Files over STREAM_THRESHOLD are copied chunk by chunk (raw, or framed), never held whole. Each
partition's SHA-256 is computed beside the writes, in a thread of its own, for the catalog
(format version 4)."""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import resource
import threading
from collections import deque
from pathlib import Path

import numpy as np

from fanfs.errors import SourceError
from fanfs.image import catalog as cat
from fanfs.image import codec
from fanfs.image.checksum import crc32
from fanfs.threads import name_os_thread

log = logging.getLogger(__name__)

# Files above this are copied raw in chunks instead of being held whole in memory.
STREAM_THRESHOLD = 256 << 20
STREAM_CHUNK = 8 << 20


# Bytes written but not hashed yet, at most: the writer waits for the hashing thread beyond.
HASH_BEHIND = 64 << 20


class Hasher:
    """The SHA-256 of each partition, of the bytes in the order they were written, computed by
    a thread of its own (hashlib lets go of the GIL) at most HASH_BEHIND bytes behind: on a raw
    dataset, hashing in the writer itself made prepare a fifth slower here."""

    def __init__(self, n_parts: int):
        self._shas = [hashlib.sha256() for _ in range(n_parts)]
        self._todo: deque[tuple[int, bytes | memoryview]] = deque()
        self._cond = threading.Condition()
        self._behind = 0
        self._done = False
        # Started at the first write, not here: prepare forks its workers after the packer is
        # made, and forks no background thread (fanfs/prepare/fanout.py).
        self._thread = threading.Thread(target=self._run, name="fanfs-hash", daemon=True)

    def add(self, part: int, data: bytes | memoryview) -> None:
        """`data` was just written to `part` (and is not changed afterwards)."""
        if self._thread.ident is None:  # the writer's first (prepare has one writer)
            self._thread.start()
        with self._cond:
            while self._behind > HASH_BEHIND:
                self._cond.wait()
            self._todo.append((part, data))
            self._behind += len(data)
            self._cond.notify_all()

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._todo and not self._done:
                    self._cond.wait()
                if not self._todo:
                    return
                part, data = self._todo.popleft()
            self._shas[part].update(data)
            with self._cond:
                self._behind -= len(data)
                self._cond.notify_all()

    def finish(self) -> bytes:
        """Every partition's digest, 32 bytes each, once all that was added is hashed."""
        with self._cond:
            self._done = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()
        return b"".join(sha.digest() for sha in self._shas)


class HashedOut:
    """A partition file being written, its bytes handed to the partitions' Hasher."""

    def __init__(self, path: Path, part: int, hasher: Hasher):
        self.file = open(path, "wb")  # noqa: SIM115  # closed by close()
        self.part = part
        self.hasher = hasher

    def write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.hasher.add(self.part, data)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _copy_stream(path: bytes, size: int, out: HashedOut, encoder: codec.Encoder) -> tuple[int, int]:
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
                    skip = encoder.skips(chunk)
                    frames = codec.FrameWriter(encoder, skip)
                if frames is not None:
                    out.write(frames.add(chunk))
                else:
                    crc = crc32(chunk, crc)
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
    return cat.CODEC_FRAMED, crc32(table)


class Packer:
    """Appends stored files to the least-filled partition of their set (normal or broadcast).

    Partitions 0..n_parts-1 are normal; the n_bcast after them hold the broadcast set.
    """

    def __init__(self, tmp: Path, n_parts: int, n_bcast: int, n_entries: int):
        total = n_parts + n_bcast
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < total + 64 <= hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (total + 64, hard))
        self.hasher = Hasher(total)
        self.outs = [HashedOut(tmp / cat.partition_name(p), p, self.hasher) for p in range(total)]
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
            out.close()
        self._digests = self.hasher.finish()

    def digests(self) -> np.ndarray:
        """Each partition's SHA-256 (the `part_sha256` column), once closed."""
        return np.frombuffer(self._digests, dtype="V32")
