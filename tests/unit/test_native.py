"""Unit tier: fanfs's C extension (fanfs/csrc/, fanfs/_native.pyx) without a mount.

The C decodes what the Python reference decodes (the zstandard package and fanfs/image/filters.py),
byte for byte, for every codec and filter and any bytes hypothesis finds, at every vector width
the CPU runs (the portable C, SSE2, AVX2); its CRC-32 is zlib's;
bytes that do not match their CRC or do not decode are refused, never returned. Jobs run with
the pool's own code (`run_job`) give back exactly the slice of the file they name, for every
shape a READ can have (a whole file, a part, one to four frames), and malformed ones are
refused. Direct reads give the same bytes as the page cache's. The pool's threads run without
FUSE too: read-aheads fill the cache of pieces, which later jobs hit, and `pool_drop` empties
it."""

from __future__ import annotations

import errno
import os
import random
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio
import zstandard
from conftest import prepare
from hypothesis import given, settings
from hypothesis import strategies as st

from fanfs import native, status
from fanfs.image import catalog as cat
from fanfs.image import codec, filters
from fanfs.native import lib
from fanfs.node import jobs
from fanfs.node import pool as native_pool
from fanfs.node.pool import NativePool
from fanfs.node.store import open_direct


def test_the_contract_is_one_version_and_one_set_of_ids() -> None:
    assert lib.API_VERSION == native.API_VERSION
    assert {name: fid for fid, name in filters.NAMES.items()} == lib.FILTERS
    assert lib.MAX_PIECES == jobs.MAX_PIECES and lib.DECODES
    assert len(status.STAGES) == lib.BUDGET_STAGES  # the latency budget's stages, named once


# The vector widths (bits) the filters' pass can be run at here: each must give the same bytes.
WIDTHS = [w for w in (0, 128, 256) if w <= lib.vectors()]


def undone_at_every_width(encoded: bytes, fid: int, size: int) -> bytes:
    """The filter's pass at each width the CPU runs: one answer, which is returned."""
    got = {w: lib.unfilter(encoded, fid, size, w) for w in WIDTHS}
    assert len(set(got.values())) == 1, {w: g == got[0] for w, g in got.items()}
    return got[0]


def test_the_widest_vectors_the_cpu_runs_are_used() -> None:
    """256 bits where the CPU has AVX2 and FMA, 128 (SSE2) on any other x86-64, none elsewhere;
    a wider pass than the CPU runs is refused, not tried (it would end the process)."""
    flags: set[str] = set()
    if os.uname().machine == "x86_64":
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    want = 256 if {"avx2", "fma"} <= flags else 128 if os.uname().machine == "x86_64" else 0
    assert lib.vectors() == want
    with pytest.raises(OSError) as refused:
        lib.unfilter(bytes(8 + 64), filters.DECIMAL4, 64, lib.vectors() + 128)
    assert refused.value.errno == errno.EINVAL


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300_000), start=st.integers(0, 2**32 - 1))
def test_crc32_is_zlibs(data: bytes, start: int) -> None:
    assert native.crc32(data, start) == zlib.crc32(data, start)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.floats(-1e5, 1e5, allow_nan=False), max_size=3000),
       decimals=st.integers(0, 4), dtype=st.sampled_from(["f4", "f8", "i4", "i8"]),
       fid=st.sampled_from(sorted(filters.NAMES)))  # fmt: skip
def test_c_filters_decode_what_python_encodes(values: list[float], decimals: int, dtype: str,
                                              fid: int) -> None:  # fmt: skip
    a = np.round(np.array(values), decimals)
    data = (a if dtype[0] == "f" else a.astype(np.int64)).astype(dtype).tobytes()
    data = data[: len(data) - len(data) % filters.WIDTH[fid]]
    encoded = filters.encode(fid, data)
    if encoded is None or not data:
        return
    stored = zstandard.ZstdCompressor().compress(encoded)
    kind = lib.KIND_FILTER + fid
    assert native.decode(stored, kind, len(data)) == data
    assert undone_at_every_width(encoded, fid, len(data)) == data
    assert codec.python_decode_piece(stored, kind, len(data)) == data
    # The same through the kind that names its filter in its first byte.
    assert native.decode(bytes((fid,)) + stored, lib.KIND_FILTERED, len(data)) == data


@settings(max_examples=150, deadline=None)
@given(words=st.integers(0, 300), body=st.randoms(use_true_random=False), small=st.booleans(),
       exp=st.integers(0, 18), spots=st.lists(st.integers(0, 299), max_size=4),
       fid=st.sampled_from(sorted(filters.NAMES)))  # fmt: skip
def test_c_filters_undo_any_bytes_as_python_does(
    words: int, body: random.Random, small: bool, exp: int, spots: list[int], fid: int
) -> None:
    """Filtered bytes no encoder made (hostile, or a decimal's sums beyond what the vector
    conversion takes): the C's blocks of 16 or 32 words and its tail give what the reference
    does, at every width. `small`: the high half of each word zero (its planes), so decimal
    sums stay in range."""
    width = filters.WIDTH[fid]
    size = words * width
    high = size // 2 if small else 0
    encoded = body.randbytes(size - high) + bytes(high)
    if fid in (filters.DECIMAL4, filters.DECIMAL8):
        exp = min(exp, 10 if width == 4 else 18)
        spots = [s for s in spots if s < words][:words]  # (more than words: both refuse)
        encoded = (struct.pack("<B3xI", exp, len(spots)) + struct.pack(f"<{len(spots)}I", *spots)
                   + body.randbytes(width * len(spots)) + encoded)  # fmt: skip
    stored = zstandard.ZstdCompressor().compress(encoded)
    want = filters.decode(fid, encoded, size)
    assert native.decode(stored, lib.KIND_FILTER + fid, size) == want
    assert undone_at_every_width(encoded, fid, size) == want


def test_an_empty_filtered_piece_is_a_threads_first() -> None:
    """A thread's first piece may be an empty filtered file (a hostile image's): it decodes to
    nothing, as the reference does, not to "no memory" (its scratch was never made)."""
    got: dict[int, object] = {}

    def first(fid: int) -> None:
        empty = b"" if fid not in (filters.DECIMAL4, filters.DECIMAL8) else bytes(8)
        try:
            stored = zstandard.ZstdCompressor().compress(empty)
            got[fid] = (native.decode(stored, lib.KIND_FILTER + fid, 0),
                        filters.decode(fid, empty, 0))  # fmt: skip
        except Exception as e:
            got[fid] = e

    for fid in sorted(filters.NAMES):
        thread = threading.Thread(target=first, args=(fid,))  # a fresh thread: no scratch yet
        thread.start()
        thread.join()
    assert got == {fid: (b"", b"") for fid in filters.NAMES}


def decimal8_stream(n: np.ndarray, exp: int) -> bytes:
    """decimal8's filtered bytes for the integers `n` at exponent `exp`, no exceptions."""
    d = np.diff(n, prepend=0)
    zigzag = ((d << 1) ^ (d >> 63)).astype("<u8")
    return struct.pack("<B3xI", exp, 0) + filters.shuffle(zigzag.view(np.uint8), 8)


@pytest.mark.parametrize("at", [0, 1, 15, 16, 17, 31, 32, 47, 63])
def test_a_value_beyond_the_vectors_range_is_divided_alone_anywhere(at: int) -> None:
    """One integer beyond what decimal8's vectors convert (hostile) among small ones, at each
    place of a 16- or 32-word step: it, and only its step, take the division alone, with the
    reference's bits; a step's other words, before and after, keep theirs."""
    rng = np.random.default_rng(at)
    n = rng.integers(-(10**6), 10**6, 64 + 7)
    n[at] = (1 << 52) + 12345 if at % 2 else -(1 << 51) - 7
    encoded = decimal8_stream(n, 2)
    want = filters.decode(filters.DECIMAL8, encoded, 8 * len(n))
    assert want == (n.astype(np.float64) / 1e2).tobytes()
    assert undone_at_every_width(encoded, filters.DECIMAL8, 8 * len(n)) == want


@pytest.mark.parametrize("exp", range(19))
def test_decimal8_quotients_are_the_divisions(exp: int) -> None:
    """decimal8's vectors divide without a division where the CPU has FMA (filters.c,
    `quotient`): every integer they take, of every size, both signs and the edges, gives the
    bits of the correctly rounded division (the reference's, which the encoder checks)."""
    rng = np.random.default_rng(exp)
    n = rng.integers(0, 1 << 51, 60_000) >> rng.integers(0, 51, 60_000)
    edges = [0, 1, -1, 2, 5, (1 << 51) - 1, -(1 << 51), (1 << 50) + 1, -(10**15)]
    n = np.concatenate([edges, n * rng.choice([-1, 1], len(n)), edges])  # (vectors, and tail)
    encoded = decimal8_stream(n, exp)
    stored = zstandard.ZstdCompressor().compress(encoded)
    want = (n.astype(np.float64) / float(f"1e{exp}")).tobytes()
    assert filters.decode(filters.DECIMAL8, encoded, 8 * len(n)) == want
    assert native.decode(stored, lib.KIND_FILTER + filters.DECIMAL8, 8 * len(n)) == want
    assert undone_at_every_width(encoded, filters.DECIMAL8, 8 * len(n)) == want


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=50_000), cut=st.integers(1, 50))
def test_bytes_that_do_not_decode_are_refused(data: bytes, cut: int) -> None:
    stored = zstandard.ZstdCompressor().compress(data)
    with pytest.raises(native.CorruptPiece):
        native.decode(stored, lib.KIND_ZSTD, len(data) + 1)  # the catalog says otherwise
    with pytest.raises(native.CorruptPiece):
        native.decode(stored[:-cut] if cut < len(stored) else b"", lib.KIND_ZSTD, len(data))
    with pytest.raises(native.CorruptPiece):
        native.decode(data, lib.KIND_RAW, len(data) + 1)


def test_the_c_leaves_the_content_checksum_to_the_crc() -> None:
    """A frame's XXH64 content checksum is not computed by the C (libzstd's
    forceIgnoreChecksum): every piece is decoded only after the CRC-32 of its stored bytes,
    checksum included, matched. A frame whose checksum alone is wrong still decodes (zstandard,
    which checks it, refuses it), and one with a wrong block is still refused."""
    data = bytes(range(256)) * 400
    stored = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    wrong_sum = stored[:-4] + bytes(b ^ 0xFF for b in stored[-4:])
    with pytest.raises(zstandard.ZstdError):
        zstandard.ZstdDecompressor().decompress(wrong_sum)
    assert native.decode(wrong_sum, lib.KIND_ZSTD, len(data)) == data
    with pytest.raises(native.CorruptPiece):
        native.decode(stored[:8] + bytes(len(stored) - 12) + stored[-4:], lib.KIND_ZSTD, len(data))


def test_dictionaries_are_taken_from_the_frame_header() -> None:
    samples = [f"row {i},{i * 7 % 13},label-{i % 5}\n".encode() * 20 for i in range(400)]
    d = zstandard.train_dictionary(4096, samples, dict_id=1)
    cctx = zstandard.ZstdCompressor(dict_data=d, write_dict_id=True)
    stored = cctx.compress(samples[3])
    dicts = native.Dictionaries([d.as_bytes()])
    assert native.decode(stored, lib.KIND_ZSTD, len(samples[3]), dicts) == samples[3]
    with pytest.raises(native.CorruptPiece):  # a frame naming a dictionary the image lacks
        native.decode(stored, lib.KIND_ZSTD, len(samples[3]))


# -- jobs over a real image -------------------------------------------------------------------


@pytest.fixture(scope="module")
def image(awkward_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(awkward_src, tmp_path_factory.mktemp("native") / "img", "--partitions", "3")


@pytest.fixture(scope="module")
def opened(image: Path) -> Iterator[tuple[cat.Catalog, list[int], list[int]]]:
    """The image's catalog, its partitions open, and opened O_DIRECT (-1 where not)."""
    c, _ = cat.Catalog.load(image)
    fds = [os.open(image / cat.partition_name(p), os.O_RDONLY) for p in range(c.n_partitions)]
    dfds = [open_direct(fd) for fd in fds]
    yield c, fds, dfds
    for fd in fds + dfds:
        if fd >= 0:
            os.close(fd)


def _table(c: cat.Catalog, fd: int, entry: int) -> codec.FrameTable:
    size, stored = int(c.size[entry]), int(c.stored_len[entry])
    off, n = codec.FrameTable.span(size, stored, c.frame_size)
    raw = os.pread(fd, n, int(c.data_off[entry]) + off)
    return codec.FrameTable(raw, size, stored, c.frame_size, int(c.crc[entry]))


def _read_job(pool: NativePool, c: cat.Catalog, fd: int, dfd: int, entry: int, offset: int,
              size: int) -> tuple[int, ...] | None:  # fmt: skip
    """The job the Reader hands the pool for this READ (None: the Reader reads it in Python:
    more frames than a job holds, or a file stored whole that is larger than the pool takes)."""
    if int(c.codec[entry]) == cat.CODEC_FRAMED:
        return pool.frames(fd, dfd, entry, _table(c, fd, entry), offset, size, range(0))
    if int(c.stored_len[entry]) > lib.PIECE_MAX or int(c.size[entry]) > lib.PIECE_MAX:
        return None
    return pool.whole(fd, dfd, entry, offset, size)


def test_jobs_answer_exactly_the_slice_they_name(
    awkward_src: Path, opened: tuple[cat.Catalog, list[int], list[int]]
) -> None:
    """Every file, whole and in READ-sized parts at awkward offsets (inside a frame, across two
    to four frames, the last byte), answered by the pool's code: the source's bytes."""
    c, fds, dfds = opened
    pool = NativePool(c, None, lambda e, err: None)
    dicts = codec.dictionaries(tuple(c.dicts))
    kinds: set[int] = set()
    for entry in np.flatnonzero(c.is_file).tolist():
        src = (awkward_src / os.fsdecode(c.path(entry))).read_bytes()
        if not src:
            continue
        p = int(c.part[entry])
        n = len(src)
        fs = c.frame_size
        ranges = {
            (0, n),
            (0, 128 << 10),
            (n - 1, 1),
            (n // 3, 4096),
            (fs - 100, 300),
            (5, 3 * fs),
            (fs + 1, 4 * fs),
        }
        for offset, size in sorted(r for r in ranges if 0 <= r[0] < n):
            size = min(size, n - offset)
            for dfd in (-1, dfds[p]):
                job = _read_job(pool, c, fds[p], dfd, entry, offset, size)
                if job is None:
                    continue
                kinds |= {job[jobs.JOB_FIELDS + 3 + 6 * k]
                          for k in range((len(job) - jobs.JOB_FIELDS) // 6)}  # fmt: skip
                assert lib.run_job(job, dicts) == src[offset : offset + size], (
                    c.path(entry), offset, size)  # fmt: skip
    assert {jobs.KIND_RAW, jobs.KIND_ZSTD, jobs.KIND_FILTERED} <= kinds
    assert any(k > jobs.KIND_FILTER for k in kinds)


def test_malformed_jobs_are_refused(opened: tuple[cat.Catalog, list[int], list[int]]) -> None:
    _, fds, _ = opened
    piece = (0, 100, 0, jobs.KIND_RAW, 100, 1)
    head = (fds[0], -1, 0, 1, 0)
    good = (*head, 10, 20, 0, *piece)
    assert lib.job_ok(good)
    bad = [
        (*head, 10, 20, 0),  # no piece
        (*head, 10, 20, 0, *piece * 5),  # more pieces than a job holds
        (*head, 90, 20, 0, *piece),  # past the pieces' end
        (*head, 0, 20, 0, *piece, *piece),  # a piece that holds none of the range
        (*head, 0, 20, 0, 0, 100, 0, jobs.KIND_RAW, 0, 1),  # an empty piece
        (*head, 0, 20, 0, -5, 100, 0, jobs.KIND_RAW, 100, 1),  # before the partition
        (*head, 0, 20, 0, 0, lib.PIECE_MAX + 1, 0, jobs.KIND_RAW, 100, 1),  # too large
        (*head, 0, 20, 0, 0, 100, 0, jobs.KIND_RAW, 100),  # a field short
        (*head, 0, 20, 0, 0, 100, "0", jobs.KIND_RAW, 100, 1),  # not a number
        (*head, 0, 2**40, 0, *piece),  # out of range
    ]
    for job in bad:
        assert not lib.job_ok(job), job
        with pytest.raises(ValueError):
            lib.run_job(job)


def test_a_wrong_checksum_or_short_partition_is_an_error(
    opened: tuple[cat.Catalog, list[int], list[int]],
) -> None:
    c, fds, dfds = opened
    entry = next(e for e in np.flatnonzero(c.is_file).tolist()
                 if int(c.codec[e]) == cat.CODEC_RAW and int(c.size[e]) > 1000)  # fmt: skip
    p, off = int(c.part[entry]), int(c.data_off[entry])
    n, crc = int(c.size[entry]), int(c.crc[entry])
    for dfd in (-1, dfds[p]):
        assert native.read(fds[p], dfd, off, n, crc, jobs.KIND_RAW, n) == os.pread(fds[p], n, off)
        with pytest.raises(native.CorruptPiece, match="checksum"):
            native.read(fds[p], dfd, off, n, crc ^ 1, jobs.KIND_RAW, n)
        end = os.fstat(fds[p]).st_size
        with pytest.raises(OSError):  # the partition ends before the piece
            native.read(fds[p], dfd, end - 10, 100, 0, jobs.KIND_RAW, 100)
        job = (fds[p], dfd, entry, entry + 1, 0, 0, n, 0, off, n, crc ^ 1, jobs.KIND_RAW, n, 0)
        with pytest.raises(native.CorruptPiece):
            lib.run_job(job)


def test_only_bad_bytes_make_a_file_bad(opened: tuple[cat.Catalog, list[int], list[int]]) -> None:
    """The pool's failure records: a failed check or decode marks the file bad for the mount;
    ENOMEM, a disk's EIO, EINTR or EAGAIN (the moment's) mark nothing."""
    c, _, _ = opened
    marked: list[int] = []
    pool = NativePool(c, None, lambda e, err: marked.append(e))
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    codes = [errno.ENOMEM, errno.EIO, errno.EINTR, errno.EAGAIN, errno.EBADMSG, errno.EILSEQ]
    os.write(wfd, b"".join(native_pool.ERROR_RECORD.pack(e, err, 0) for e, err in enumerate(codes)))
    os.close(wfd)
    pool._rfd = rfd
    try:
        trio.run(pool.errors)  # ends at the pipe's end
    finally:
        os.close(rfd)
    assert marked == [4, 5]


def test_direct_reads_are_used_when_the_page_cache_lacks_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "part"
    data = np.random.default_rng(1).bytes(3 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    dfd = open_direct(fd)
    try:
        if dfd < 0:
            pytest.fail(f"{tmp_path}: no O_DIRECT here (this machine's /tmp is ext4)")
        piece = (12345, 2 << 20, zlib.crc32(data[12345 : 12345 + (2 << 20)]))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = lib.read_stats()
        got = native.read(fd, dfd, *piece, jobs.KIND_RAW, piece[1])
        after = lib.read_stats()
        assert got == data[12345 : 12345 + (2 << 20)]
        assert after["direct"] == before["direct"] + 1  # not in the page cache: read direct
        os.pread(fd, len(data), 0)  # now it is
        assert native.read(fd, dfd, *piece, jobs.KIND_RAW, piece[1]) == got
        assert lib.read_stats()["cached"] == after["cached"] + 1
    finally:
        os.close(fd)
        if dfd >= 0:
            os.close(dfd)


def test_the_pool_runs_without_fuse(
    awkward_src: Path, opened: tuple[cat.Catalog, list[int], list[int]]
) -> None:
    """Read-aheads of a framed file's frames fill the cache of pieces; jobs for those frames
    then hit it; pool_drop empties it, and the same job misses again."""
    c, fds, dfds = opened
    entry = c.resolve(b"fields/big.f32")
    assert entry is not None and int(c.codec[entry]) == cat.CODEC_FRAMED
    p = int(c.part[entry])
    table = _table(c, fds[p], entry)
    src = (awkward_src / "fields/big.f32").read_bytes()
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    lib.pool_start(4, wfd)
    try:
        lib.pool_dicts(codec.dictionaries(tuple(c.dicts)))
        jobs_before = lib.pool_stats()["jobs"]
        for i in range(len(table)):
            ahead = jobs.job(fds[p], dfds[p], entry, i * c.frame_size, 0, 0, 0,
                             [jobs.frame_piece(c, entry, table, i)])  # fmt: skip
            assert lib.pool_read_ahead(ahead)
        pool = NativePool(c, None, lambda e, err: None)
        job = pool.frames(fds[p], dfds[p], entry, table, c.frame_size + 7, 1000, range(0))
        assert job is not None
        deadline = time.monotonic() + 30
        while lib.pool_stats()["jobs"] < jobs_before + len(table):  # taken by the pool's threads
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hits = lib.pool_stats()["hits"]
        assert lib.run_job(job) == src[c.frame_size + 7 : c.frame_size + 1007]
        assert lib.pool_stats()["hits"] == hits + 1
        # A read-ahead taken may still be reading when pool_drop runs and fill its piece just
        # after (seen under AddressSanitizer, and when a loaded machine preempts its thread):
        # drop again, a little later, until the job misses. Each frame is read ahead once, so
        # that ends once the read-aheads have.
        deadline = time.monotonic() + 30
        while True:
            lib.pool_drop()
            misses = lib.pool_stats()["misses"]
            assert lib.run_job(job) == src[c.frame_size + 7 : c.frame_size + 1007]
            if lib.pool_stats()["misses"] == misses + 1:
                break
            assert time.monotonic() < deadline, "pool_drop left the piece in the cache"
            time.sleep(0.01)
    finally:
        lib.pool_stop()
        os.close(wfd)
        assert os.read(rfd, 4096) == b""  # no failure was posted
        os.close(rfd)
