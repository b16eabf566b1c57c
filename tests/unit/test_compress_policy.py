"""Unit tier: what prepare's compression stores, no mount: `auto` takes every codec path and
only where it pays, `none` stores everything raw, and `info` plans capacity (how many nodes an
image needs). Reading it all back through a mount: tests/mount/test_compression.py."""

from __future__ import annotations

import gzip
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import fanfs, prepare
from PIL import Image

from fanfs.bench import datagen
from fanfs.errors import ExitCode
from fanfs.image import catalog as cat
from fanfs.image import codec, filters
from fanfs.image.verify import nodes_needed

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
