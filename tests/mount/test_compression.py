"""Mount tier: compression that pays: every codec path is really taken, reads back byte for byte
(also at random offsets inside framed files), corrupt frames are caught, and `info` plans
capacity."""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard
from catalogs import rewrite
from conftest import fanfs, mounted, prepare
from PIL import Image

from fanfs import catalog as cat
from fanfs import codec, datagen, filters
from fanfs.errors import CorruptFile, ExitCode
from fanfs.image import nodes_needed
from fanfs.node import pool as native

AUTO = codec.Encoder(codec.Policy("auto"))
ZSTD = codec.Encoder(codec.Policy("zstd"))


def _frame_kinds(image: Path, c: cat.Catalog, entry: int) -> set[str]:
    """Which kinds of frames (raw, zstd, or a filter's name) a framed file's table lists."""
    size, stored = int(c.size[entry]), int(c.stored_len[entry])
    off, n = codec.FrameTable.span(size, stored, c.frame_size)
    with open(image / cat.partition_name(int(c.part[entry])), "rb") as f:
        raw = os.pread(f.fileno(), n, int(c.data_off[entry]) + off)
    table = codec.FrameTable(raw, size, stored, c.frame_size, int(c.crc[entry]))
    kinds = set()
    for i in range(len(table)):
        if table.filters[i]:
            kinds.add(filters.NAMES[int(table.filters[i])])
        else:
            kinds.add("raw" if table.stored(i)[1] == table.decoded_len(i) else "zstd")
    return kinds


def test_auto_takes_every_codec_path(awkward_src: Path, tmp_path: Path) -> None:
    image = prepare(awkward_src, tmp_path / "img")  # auto is the default
    c, _ = cat.Catalog.load(image)

    def codec_of(rel: bytes) -> str:
        entry = c.resolve(rel)
        assert entry is not None, rel
        return cat.CODEC_NAMES[int(c.codec[entry])]

    assert c.meta["compress"] == "auto:3" and len(c.dicts) >= 1
    assert codec_of(b"tables/t07.csv") == "zstd-dict"
    assert codec_of(b"sizes/compressible-1m.txt") == "zstd"
    assert codec_of(b"fields/small.f32") == "zstd-delta4"
    for rel, fid in ((b"fields/prices.f32", filters.DECIMAL4),
                     (b"arrays/labels.i32", filters.SHUFFLE4)):  # fmt: skip
        assert codec_of(rel) == "zstd-filtered"
        entry = c.resolve(rel)
        assert entry is not None
        with open(image / cat.partition_name(int(c.part[entry])), "rb") as f:
            assert os.pread(f.fileno(), 1, int(c.data_off[entry])) == bytes((fid,)), rel
    assert codec_of(b"images/noise.jpg") == "raw"
    assert codec_of(b"images/noise.png") == "raw"
    assert codec_of(b"sizes/exact-131072.bin") == "raw"  # random bytes
    assert codec_of(b"fields/big.f32") == "framed"
    assert codec_of(b"big/over-64mib.bin") == "framed"
    big_field, big_mixed = c.resolve(b"fields/big.f32"), c.resolve(b"big/over-64mib.bin")
    assert big_field is not None and big_mixed is not None
    # Every frame of the smooth field filtered (float32 near 280 are also decimals at e = 5).
    assert _frame_kinds(image, c, big_field) <= {"delta4", "decimal4"}
    walk = c.resolve(b"fields/walk.f64")
    assert walk is not None and _frame_kinds(image, c, walk) == {"decimal8"}
    assert _frame_kinds(image, c, big_mixed) >= {"raw", "zstd"}
    assert fanfs("verify", image).returncode == 0


def _python_decode(image: Path, c: cat.Catalog, entry: int) -> tuple[bytes, set[int]]:
    """(decoded bytes, filters used) of a file, decoded by fanfs.codec from the image."""
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
    filter, decoded by fanfs.codec (Python) and by the native pool (C, through a mount), is
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


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("jpeg", "jpeg"),
        ("png", "png"),
        ("gzip", gzip.compress(b"text " * 20000)),
        ("deflated zip", "zip-deflated"),
    ],
)
def test_auto_stores_compressed_formats_raw(kind: str, data: bytes | str) -> None:
    rng = np.random.default_rng(2)
    smooth = (np.outer(np.arange(256), np.ones(256)) % 256).astype(np.uint8)
    if data in ("jpeg", "png"):
        buf = io.BytesIO()
        Image.fromarray(np.stack([smooth] * 3, axis=-1)).save(buf, format=str(data))
        data = buf.getvalue()
    elif data == "zip-deflated":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("a.txt", b"text " * 20000 + rng.bytes(100))
        data = buf.getvalue()
    assert isinstance(data, bytes)
    assert codec.already_compressed(data[:16]), kind
    codec_id, stored, crc = AUTO.encode(data)
    assert codec_id == cat.CODEC_RAW and stored == data
    assert codec.decode(stored, codec_id, len(data), crc) == data


def test_auto_compresses_what_pays_and_only_that() -> None:
    rng = np.random.default_rng(3)
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros(50_000, dtype=np.float32))  # a stored (uncompressed) zip
    npz = buf.getvalue()
    assert not codec.already_compressed(npz[:16])
    codec_id, stored, crc = AUTO.encode(npz)
    assert codec_id == cat.CODEC_ZSTD and len(stored) < len(npz) // 10
    assert codec.decode(stored, codec_id, len(npz), crc) == npz
    # Saves about 5 %: zstd keeps it compressed, auto keeps it raw (not worth decoding).
    slight = b"a" * 5000 + rng.bytes(95_000)
    assert ZSTD.encode(slight)[0] == cat.CODEC_ZSTD
    assert AUTO.encode(slight)[0] == cat.CODEC_RAW
    field = datagen.smooth_field(rng, 200, 200).tobytes()
    codec_id, stored, crc = AUTO.encode(field)
    assert codec_id == cat.CODEC_ZSTD_DELTA4 and len(stored) * 2 < len(field)
    assert codec.decode(stored, codec_id, len(field), crc) == field
    for n in (0, 4, 12, 4096, 1 << 20):
        words = rng.bytes(n)
        assert codec.undelta4(codec.delta4(words)) == words


def test_none_stores_everything_raw(awkward_src: Path, tmp_path: Path) -> None:
    c, _ = cat.Catalog.load(prepare(awkward_src, tmp_path / "img", "--compress", "none"))
    assert not c.dicts and set(np.unique(c.codec[c.is_file]).tolist()) == {cat.CODEC_RAW}


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


def test_nodes_needed() -> None:
    sizes = np.array([10, 10, 10, 10, 10, 10, 10, 10])
    flags = np.zeros(8, dtype=np.uint32)
    assert nodes_needed(sizes, flags, 80) == 1
    assert nodes_needed(sizes, flags, 20) == 4
    assert nodes_needed(sizes, flags, 25) == 4  # whole partitions: 3 nodes would need 30
    assert nodes_needed(sizes, flags, 9) is None  # no partition fits anywhere
    assert nodes_needed(sizes, flags, 20, replicas=2) == 8
    bcast = np.array([5, 10, 10, 10, 10])
    assert nodes_needed(bcast, np.array([1, 0, 0, 0, 0]), 25) == 2  # 5 on every node
    assert nodes_needed(bcast, np.array([1, 0, 0, 0, 0]), 14) is None


def test_info_reports_ratios_and_nodes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(6)
    for i in range(32):
        (src / f"t{i:02d}.csv").write_bytes(datagen.csv_table(rng, 6000))  # ~280 KiB each
    for i in range(8):
        pixels = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(src / f"i{i}.jpg", quality=90)
    image = prepare(src, tmp_path / "img", "--partitions", "8")
    done = fanfs("info", image, "--local-capacity", "2M", "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    rows = {r["extension"]: r for r in d["by_extension"]}
    assert rows[".csv"]["ratio"] > 3 and rows[".jpg"]["ratio"] == 1.0
    assert sum(r["files"] for r in rows.values()) == d["files"]
    assert sum(r["bytes_stored"] for r in rows.values()) == d["bytes_stored"]
    cap = d["capacity"]
    assert cap["local_capacity"] == 2 << 20
    c, _ = cat.Catalog.load(image)
    assert cap["nodes"] == nodes_needed(c.part_size, c.part_flags, 2 << 20)
    assert cap["nodes"] is not None and cap["nodes_uncompressed"] is not None
    assert cap["nodes"] < cap["nodes_uncompressed"]
    text = fanfs("info", image, "--local-capacity", "2M")
    assert f"{cap['nodes']} as prepared, {cap['nodes_uncompressed']} uncompressed" in text.stdout
    assert ".csv" in text.stdout
    bad = fanfs("info", image, "--local-capacity", "lots")
    assert bad.returncode == ExitCode.USAGE and "not a size" in bad.stderr
