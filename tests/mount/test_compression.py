"""Mount tier: compressed images read back through a mount byte for byte (also at random
offsets inside framed files), the native and Python decoders agree, and stored bytes that do
not decode or a corrupt frame are EIO for that file only. What prepare's compression stores,
and `info`'s capacity plan: tests/unit/test_compress_policy.py."""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard
from catalogs import rewrite
from conftest import fanfs, mounted, prepare

from fanfs.bench import datagen
from fanfs.errors import CorruptFile, ExitCode
from fanfs.image import catalog as cat
from fanfs.image import codec, filters
from fanfs.node import pool as native


def _python_decode(image: Path, c: cat.Catalog, entry: int) -> tuple[bytes, set[int]]:
    """(decoded bytes, filters used) of a file, decoded by fanfs.image.codec from the image."""
    size, stored_len = int(c.size[entry]), int(c.stored_len[entry])
    with open(image / cat.partition_name(int(c.part[entry])), "rb") as f:
        stored = os.pread(f.fileno(), stored_len, int(c.data_off[entry]))
    codec_id = int(c.codec[entry])
    if codec_id != cat.CODEC_FRAMED:
        used = {stored[0]} if codec_id == cat.CODEC_ZSTD_FILTERED else set()
        if codec_id == cat.CODEC_ZSTD_DELTA4:
            used = {filters.DELTA4}
        return codec.decode(stored, codec_id, size, int(c.crc[entry]), c.dicts), used
    off, n = codec.FrameTable.span(size, stored_len, c.frame_size)
    crc = int(c.crc[entry])
    table = codec.FrameTable(stored[off : off + n], size, stored_len, c.frame_size, crc)
    frames = []
    for i in range(len(table)):
        f_off, f_len = table.stored(i)
        frames.append(table.decode(i, stored[f_off : f_off + f_len]))
    return b"".join(frames), {int(x) for x in table.filters if x}


def test_native_and_python_decoders_agree(awkward_src: Path, tmp_path: Path) -> None:
    """One stored format, two decoders: every file of an image that uses every codec and every
    filter, decoded by fanfs.image.codec (Python) and by the native pool (C, through a mount), is
    the source, byte for byte."""
    image = prepare(awkward_src, tmp_path / "img")
    c, _ = cat.Catalog.load(image)
    files = [e for e in range(c.n_entries) if c.is_file[e]]
    used: set[int] = set()
    for entry in files:
        data, fids = _python_decode(image, c, entry)
        assert data == (awkward_src / os.fsdecode(c.path(entry))).read_bytes(), c.path(entry)
        used |= fids
    assert used == set(filters.NAMES), used  # the image exercises every filter
    whole = [e for e in files if int(c.codec[e]) not in (cat.CODEC_RAW, cat.CODEC_FRAMED)]
    codecs = {int(c.codec[e]) for e in whole}
    assert codecs == {cat.CODEC_ZSTD, cat.CODEC_ZSTD_DICT, cat.CODEC_ZSTD_DELTA4,
                      cat.CODEC_ZSTD_FILTERED}  # fmt: skip
    # Files compressed whole first: every READ of them must be a native job, none decoded
    # in Python (every local fetch is one of the pool's).
    small = [e for e in whole if int(c.size[e]) <= native.PARTS_LIMIT]
    assert small == whole
    files = small + [e for e in files if e not in small]
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        for i, entry in enumerate(files):
            rel = os.fsdecode(c.path(entry))
            assert (m.mountpoint / rel).read_bytes() == (awkward_src / rel).read_bytes(), rel
            if i == len(small) - 1:
                st = m.status()
                reader = st["reader"]  # the first READ of a partition comes through Python
                assert reader["native_jobs"] + st["native_fast_reads"] >= len(small), st
                assert reader["local_fetches"] == reader["native_jobs"], reader
        status = m.status()
        assert status["native_decodes"] and status["reader"]["bad_files"] == 0
        assert status["native_frame_misses"] > 0  # frames of framed files were decoded in C
        # Read in order, 1 MiB at a time: the frames after each READ's were decoded ahead.
        assert status["native_frame_hits"] > 0


def _replace_stored(image: Path, c: cat.Catalog, entry: int, stored: bytes) -> None:
    """Put `stored` where `entry`'s stored bytes are (no longer than they were), with a catalog
    that agrees: its length and CRC-32, so only decoding can tell."""
    assert len(stored) <= int(c.stored_len[entry])
    with open(image / cat.partition_name(int(c.part[entry])), "r+b") as f:
        os.pwrite(f.fileno(), stored, int(c.data_off[entry]))

    def change(columns: dict[str, np.ndarray], strings: bytes) -> None:
        columns["stored_len"][entry] = len(stored)
        columns["crc"][entry] = zlib.crc32(stored)

    rewrite(image, change)


def test_stored_bytes_that_do_not_decode_are_eio_for_that_file(
    awkward_src: Path, tmp_path: Path
) -> None:
    """A hostile image whose checksums match but whose bytes do not decode: random bytes for a
    zstd frame, and valid zstd frames of the wrong length behind a filter (decimal4, shuffle4).
    The native pool (and Python, should a READ reach it) answers EIO for those files alone,
    every time, logged once each; a pool that answered their garbage would fail the test."""
    image = prepare(awkward_src, tmp_path / "img")
    c, _ = cat.Catalog.load(image)
    z = zstandard.ZstdCompressor()
    victims = {
        "arrays/labels.i32": os.urandom(100),
        "fields/prices.f32": bytes((filters.DECIMAL4,)) + z.compress(b"\x07" * 999),
        "arrays/ids.i64": bytes((filters.SHUFFLE8,)) + z.compress(b"\x01" * 1000),
        "fields/small.f32": z.compress(b"\x01" * 1000),  # zstd-delta4 of the wrong length
        # Large ones (about 1.3 MiB stored, answered in parts through the frame cache):
        # a valid frame that ends short of the file's size, and garbage.
        "fields/noisy-b.f32": bytes((filters.SHUFFLE4,))
        + zstandard.ZstdCompressor(level=-5).compress(os.urandom(1 << 20)),
        "fields/noisy.f32": os.urandom(300 << 10),
    }
    for rel, stored in victims.items():
        entry = c.resolve(os.fsencode(rel))
        assert entry is not None and int(c.codec[entry]) != cat.CODEC_RAW
        _replace_stored(image, c, entry, stored)
        c, _ = cat.Catalog.load(image)
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        for _ in range(2):
            for rel in victims:
                with pytest.raises(OSError) as err:
                    (m.mountpoint / rel).read_bytes()
                assert err.value.errno == errno.EIO, rel
        for rel in ("tables/t07.csv", "fields/walk.f64", "arrays/smooth.f64", "fields/big.f32"):
            assert (m.mountpoint / rel).read_bytes() == (awkward_src / rel).read_bytes()
        # Logged once each, by the pool ("stored bytes do not decode") or by Python, which
        # the kernel's retry of a failed readahead (a one-page READ) may reach first.
        log = m.log_text()
        for rel in victims:
            assert log.count(f"EIO for /{rel}: ") == 1, log
        assert m.status()["reader"]["bad_files"] == len(victims)


def test_framed_files_read_at_any_offset(awkward_src: Path, tmp_path: Path) -> None:
    image = prepare(awkward_src, tmp_path / "img", "--compress", "zstd")
    rng = np.random.default_rng(11)
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        for rel in ("fields/big.f32", "big/over-64mib.bin"):
            want = (awkward_src / rel).read_bytes()
            size = len(want)
            fs = codec.FRAME_SIZE
            # Frame edges, the tail, and random ranges, several crossing frames.
            offsets = [0, fs - 1, fs, 2 * fs - 3, size - 1, size - fs - 7]
            offsets += rng.integers(0, size, 40).tolist()
            with open(m.mountpoint / rel, "rb") as f:
                for off in offsets:
                    n = int(rng.choice([1, 4096, 100_000, fs + 3, 3 * fs]))
                    assert os.pread(f.fileno(), n, off) == want[off : off + n], (rel, off, n)
            assert (m.mountpoint / rel).read_bytes() == want


def _framed_src(base: Path) -> Path:
    src = base / "src"
    (src / "d").mkdir(parents=True)
    rng = np.random.default_rng(4)
    (src / "d/field.f32").write_bytes(datagen.smooth_field(rng, 1100, 1100).tobytes())
    for i in range(10):
        (src / f"d/f{i}.txt").write_bytes(b"line %d\n" % i * (500 + i))
    return src


def test_corrupt_frame_gives_eio_for_that_file_only(tmp_path: Path) -> None:
    src = _framed_src(tmp_path)
    image = prepare(src, tmp_path / "img", "--partitions", "2")
    c, _ = cat.Catalog.load(image)
    victim = c.resolve(b"d/field.f32")
    assert victim is not None and int(c.codec[victim]) == cat.CODEC_FRAMED
    size, stored_len = int(c.size[victim]), int(c.stored_len[victim])
    off, n = codec.FrameTable.span(size, stored_len, c.frame_size)
    part = image / cat.partition_name(int(c.part[victim]))
    data = bytearray(part.read_bytes())
    start = int(c.data_off[victim])
    table = codec.FrameTable(bytes(data[start + off : start + off + n]), size, stored_len,
                             c.frame_size, int(c.crc[victim]))  # fmt: skip
    f_off, f_len = table.stored(2)
    data[start + f_off + f_len // 2] ^= 0x55
    part.write_bytes(bytes(data))

    done = fanfs("verify", image)
    assert done.returncode == ExitCode.FAILED
    assert done.stdout.splitlines() == [
        f"d/field.f32: frame 2: checksum mismatch (partition {int(c.part[victim])})"
    ]
    with pytest.raises(CorruptFile, match="frame 2"):
        table.decode(2, bytes(data[start + f_off : start + f_off + f_len]))

    want = (src / "d/field.f32").read_bytes()
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        with open(m.mountpoint / "d/field.f32", "rb") as f:
            # Frame 0 is intact: readable until the bad frame is touched.
            assert os.pread(f.fileno(), 1000, 10) == want[10:1010]
        with pytest.raises(OSError) as err:
            (m.mountpoint / "d/field.f32").read_bytes()
        assert err.value.errno == 5
        for i in range(10):  # every other file is fine
            assert (m.mountpoint / f"d/f{i}.txt").read_bytes() == (src / f"d/f{i}.txt").read_bytes()
        assert "EIO for /d/field.f32" in m.log_text()
