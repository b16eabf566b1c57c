"""Adapter tier: the pieces of the read path built alone, without a mount.

Every array filter and every codec round-trips (decode of encode is the input, for any input
hypothesis finds); the native pool's jobs are what its C side takes (fanfs/node/pool.py builds
them, fanfs/csrc/pool.c checks them); the peer server refuses what it must and locates only
what a plain read answers. The C itself: tests/unit/test_native.py."""

from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import parts
import pytest
from conftest import prepare
from hypothesis import given, settings
from hypothesis import strategies as st

from fanfs.image import catalog as cat
from fanfs.image import codec, filters
from fanfs.native import lib
from fanfs.node import pool as native
from fanfs.node.pool import NativePool
from fanfs.node.sources import PeerServer
from fanfs.node.store import PartitionStore

ARRAYS = st.sampled_from(["f4", "f8", "i4", "i8", "u1"])


def array(kind: str, values: list[float], decimals: int) -> bytes:
    a = np.array(values, dtype=np.float64)
    if kind[0] == "f":
        return np.round(a, decimals).astype(kind).tobytes()
    return a.astype(np.int64).astype(kind).tobytes()


@settings(max_examples=200, deadline=None)
@given(kind=ARRAYS, values=st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=400),
       decimals=st.integers(0, 4), fid=st.sampled_from(sorted(filters.NAMES)))  # fmt: skip
def test_every_filter_round_trips(kind: str, values: list[float], decimals: int, fid: int) -> None:
    data = array(kind, values, decimals)
    width = filters.WIDTH[fid]
    data = data[: len(data) - len(data) % width]
    encoded = filters.encode(fid, data)
    if encoded is None:  # the filter does not apply (decimal: not decimals): fine, it says so
        return
    assert len(encoded) <= filters.max_filtered_size(fid, len(data))
    assert filters.decode(fid, encoded, len(data)) == data


@settings(max_examples=100, deadline=None)
@given(data=st.one_of(st.binary(max_size=20_000),
                      st.builds(lambda v: array("f4", v, 2), st.lists(st.floats(-1e4, 1e4),
                                                                     max_size=5000))),
       mode=st.sampled_from(["none", "zstd", "auto"]))  # fmt: skip
def test_every_codec_round_trips(data: bytes, mode: str) -> None:
    encoder = codec.Encoder(codec.parse_compress(mode))
    codec_id, stored, crc = encoder.encode(data)
    assert zlib.crc32(stored) == crc
    if codec_id == cat.CODEC_FRAMED:
        return  # frames: below
    assert codec.decode(stored, codec_id, len(data), crc) == data


def test_framed_files_round_trip_frame_by_frame() -> None:
    rng = np.random.default_rng(3)
    data = (np.cumsum(rng.normal(size=(5 << 20) // 4)).astype(np.float32).tobytes()
            + rng.bytes(1234))  # fmt: skip
    encoder = codec.Encoder(codec.parse_compress("zstd"))
    codec_id, stored, crc = encoder.encode(data)
    assert codec_id == cat.CODEC_FRAMED
    off, n = codec.FrameTable.span(len(data), len(stored), codec.FRAME_SIZE)
    table = codec.FrameTable(stored[off : off + n], len(data), len(stored), codec.FRAME_SIZE, crc)
    out = b"".join(table.decode(i, stored[a : a + k]) for i, (a, k) in
                   enumerate(table.stored(i) for i in range(len(table))))  # fmt: skip
    assert out == data and any(int(f) for f in table.filters)  # an array filter was used


# -- the native pool's jobs -------------------------------------------------------------------


def catalog_of(entries: list[tuple[int, int, int, int, int]]) -> Any:
    """A catalog-like record: per entry (size, stored_len, data_off, crc, codec)."""
    cols = np.array(entries, dtype=np.uint64).T
    return SimpleNamespace(size=cols[0], stored_len=cols[1], data_off=cols[2], crc=cols[3],
                           codec=cols[4].astype(np.uint8), n_entries=len(entries),
                           frame_size=1 << 20, dicts=[])  # fmt: skip


def test_native_jobs_are_what_the_pool_takes() -> None:
    c = catalog_of([(1000, 1000, 64, 11, cat.CODEC_RAW), (5000, 900, 2048, 22, cat.CODEC_ZSTD),
                    (4000, 800, 4096, 33, cat.CODEC_ZSTD_DELTA4)])  # fmt: skip
    pool = NativePool(c, None, lambda e, err: None)
    push = lib.JOB_PUSH
    # A whole raw file asked whole: one piece, not kept in the pool's cache, nothing to push.
    whole = pool.whole(7, 8, 0, 0, 1000)
    assert whole == (7, 8, 0, 1, 0, 0, 1000, 0, 64, 1000, 11, native.KIND_RAW, 1000, 0)
    # A part of a compressed file: the whole piece decoded, kept for the other parts, and the
    # rest pushed to the kernel.
    part = pool.whole(7, -1, 1, 100, 50)
    assert part == (7, -1, 1, 2, 0, 100, 50, push, 2048, 900, 22, native.KIND_ZSTD, 5000, 1)
    assert pool.whole(7, -1, 2, 0, 4000)[native.JOB_FIELDS + 3] == native.KIND_FILTER + 8
    assert NativePool(c, None, lambda e, err: None, push=False).whole(7, -1, 1, 1, 2)[7] == 0
    # Frames: the ones a READ touches, its range within them, the first one's place.
    fs = 1 << 20
    lengths = [300, fs, 200, 100, 100]  # frame 1 stored raw
    table_bytes = np.array([(n, 1000 + i) for i, n in enumerate(lengths)], dtype="<u4").tobytes()
    size = 4 * fs + 10
    stored_len = sum(lengths) + len(table_bytes)
    table = codec.FrameTable(table_bytes, size, stored_len, fs, None)
    job = pool.frames(9, -1, 1, table, fs - 10, 30, range(0))
    assert job is not None and job[: native.JOB_FIELDS] == (9, -1, 1, 2, 0, fs - 10, 30, push)
    pieces = [job[native.JOB_FIELDS + 6 * k : native.JOB_FIELDS + 6 + 6 * k]
              for k in range((len(job) - native.JOB_FIELDS) // 6)]  # fmt: skip
    assert pieces == [(2048, 300, 1000, native.KIND_ZSTD, fs, 1),
                      (2048 + 300, fs, 1001, native.KIND_RAW, fs, 1)]  # fmt: skip
    later = pool.frames(9, -1, 1, table, 2 * fs + 5, 10, range(0))
    assert later is not None and later[4:7] == (2 * fs, 5, 10)  # its first frame's place
    assert pool.frames(9, -1, 1, table, 0, 4 * fs + 10, range(0)) is None  # over MAX_PIECES
    assert pool.jobs == 5
    # Every job built is one the C takes.
    assert all(lib.job_ok(j) for j in (whole, part, job, later))


# -- the peer server --------------------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path) -> Any:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "small.bin").write_bytes(b"x" * 5000)
    (src / "large.bin").write_bytes(np.random.default_rng(0).bytes(20 << 20))
    image = prepare(src, tmp_path / "img", "--compress", "none", "--partitions", "2")
    c, _ = cat.Catalog.load(image)
    store = PartitionStore(image, c, tmp_path / "local", range(c.n_partitions))
    try:
        yield c, PeerServer(c, parts.local(c, store))
    finally:
        store.close()


async def test_the_peer_server_refuses_what_it_must(served: Any) -> None:
    c, server = served
    small, large, d = c.resolve(b"d/small.bin"), c.resolve(b"large.bin"), c.resolve(b"d")
    assert await server.serve(small, 0, 5000) == b"x" * 5000
    for entry, off, n in ((d, 0, 1), (small, 0, 5001), (small, -1, 10), (small, 10, 0),
                          (c.n_entries, 0, 1), (-1, 0, 1)):  # fmt: skip
        assert await server.serve(entry, off, n) is None
        assert server.locate(entry, off, n) is None
    assert server.locate(small, 100, 10) == (int(c.part[small]), int(c.data_off[small]) + 100)
    # A large raw file is located for the transport's threads only once it has been checked.
    assert server.locate(large, 0, 4096) is None
    assert len(await server.serve(large, 1 << 20, 4096)) == 4096
    assert server.locate(large, 0, 4096) is not None


async def test_a_peer_server_serves_only_its_partitions(served: Any) -> None:
    c, server = served
    elsewhere = PeerServer(c, parts.local(c, server.local.store, rank=0,
                                          owners=[(1,)] * c.n_partitions))  # fmt: skip
    small = c.resolve(b"d/small.bin")
    assert await elsewhere.serve(small, 0, 10) is None and elsewhere.locate(small, 0, 10) is None
