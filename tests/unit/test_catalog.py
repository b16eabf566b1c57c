"""Unit tier: the catalog and prepare's packing, no mount."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from catalogs import columns_of
from conftest import prepare

from fanfs.errors import CorruptCatalog, ImageVersionError
from fanfs.image import catalog as cat
from fanfs.image.checksum import crc32
from fanfs.prepare.source import default_partitions


def test_every_path_resolves_to_its_own_entry(awkward_image: Path, awkward_src: Path) -> None:
    c, _ = cat.Catalog.load(awkward_image)
    seen = 0
    for entry, path in c.walk():
        assert c.resolve(path) == entry
        assert os.path.lexists(os.path.join(os.fsencode(awkward_src), path))
        seen += 1
    assert seen == c.n_entries - 1
    assert c.lookup(0, b"no-such-name") is None
    assert c.resolve(b"many/c1/nope") is None


def test_children_are_contiguous_and_sorted(awkward_image: Path) -> None:
    c, _ = cat.Catalog.load(awkward_image)
    for d in np.flatnonzero(c.is_dir):
        names = [c.name(e) for e in c.children(int(d))]
        assert names == sorted(names)
        assert all(int(c.parent[e]) == d for e in c.children(int(d)))


def test_catalog_is_compact(awkward_image: Path) -> None:
    c, raw = cat.Catalog.load(awkward_image)
    names = sum(len(c.name(e)) for e in range(c.n_entries))
    dicts = sum(len(d) for d in c.dicts)  # zstd dictionaries: per image, not per entry
    assert (c.memory_bytes() - len(c.strings) - dicts) / c.n_entries < 82  # 77 + nlink's 4
    assert len(c.strings) >= names
    assert cat.Catalog.from_bytes(raw).n_entries == c.n_entries


def test_blocks_are_what_the_source_allocated(awkward_image: Path, awkward_src: Path) -> None:
    """st_blocks of every entry is its source's lstat, symlinks and directories included: what
    du and cp's sparse test read (the size rounded up overstated every sparse file)."""
    c, _ = cat.Catalog.load(awkward_image)
    assert c.version == cat.VERSION == 4
    assert int(c.blocks[0]) == os.stat(awkward_src).st_blocks
    for entry, path in c.walk():
        st = os.lstat(os.path.join(os.fsencode(awkward_src), path))
        assert int(c.blocks[entry]) == st.st_blocks, path


def test_each_partition_has_its_sha256(awkward_image: Path) -> None:
    """Format 4: the catalog records each partition file's SHA-256 (what a kept copy of it is
    keyed by), computed by prepare as it wrote the file."""
    c, _ = cat.Catalog.load(awkward_image)
    assert c.part_sha256 is not None and len(c.part_sha256) == c.n_partitions
    for p in range(c.n_partitions):
        data = (awkward_image / cat.partition_name(p)).read_bytes()
        assert c.part_sha256[p].tobytes() == hashlib.sha256(data).digest(), p


def test_a_version_2_catalog_reads_as_before(awkward_image: Path) -> None:
    """Images prepared before `blocks` (format 2) load unchanged, their blocks the size rounded
    up to 512 bytes as fanfs answered then; versions it does not know are refused by number."""
    raw = (awkward_image / cat.CATALOG_NAME).read_bytes()
    columns, strings, meta, frame_size = columns_of(raw)
    old = cat.encode(columns, strings, meta, frame_size=frame_size, version=2)
    digests = 32 * len(columns["part_size"])
    assert len(old) == len(raw) - cat._padded(8 * len(columns["blocks"])) - digests
    c2, c4 = cat.Catalog.from_bytes(old), cat.Catalog.from_bytes(raw)
    assert c2.version == 2 and c2.part_sha256 is None
    for name, _ in cat.ENTRY_COLUMNS + cat.PARTITION_COLUMNS:
        if name not in ("blocks", "part_sha256"):
            assert np.array_equal(getattr(c2, name), getattr(c4, name)), name
    assert c2.blocks.tolist() == [(int(s) + 511) // 512 for s in c2.size]
    assert c2.dicts == c4.dicts and c2.strings == c4.strings
    c3 = cat.Catalog.from_bytes(cat.encode(columns, strings, meta, frame_size=frame_size,
                                           version=3))  # fmt: skip
    assert c3.version == 3 and c3.part_sha256 is None
    assert np.array_equal(c3.blocks, c4.blocks)
    for version, hint in ((1, "prepare the image again"), (5, "reads versions 2, 3 and 4")):
        fields = list(cat.HEADER.unpack_from(raw))
        fields[1], fields[2] = version, 0
        fields[2] = crc32(cat.HEADER.pack(*fields))
        with pytest.raises(ImageVersionError, match=hint):
            cat.Catalog.from_bytes(cat.HEADER.pack(*fields) + raw[cat.HEADER.size :])


def test_blocks_past_what_stat_can_carry_are_refused(awkward_image: Path) -> None:
    """du and pyfuse3 (blkcnt_t) turn st_blocks into a signed 64-bit byte count: a hostile
    image may claim anything up to that (a source may hold blocks past its end), not more."""
    raw = (awkward_image / cat.CATALOG_NAME).read_bytes()
    columns, strings, meta, frame_size = columns_of(raw)
    columns["blocks"][-1] = cat.BLOCKS_MAX
    c = cat.Catalog.from_bytes(cat.encode(columns, strings, meta, frame_size=frame_size))
    assert int(c.blocks[-1]) * 512 <= 2**63 - 1
    columns["blocks"][-1] = cat.BLOCKS_MAX + 1
    with pytest.raises(CorruptCatalog, match="allocated blocks"):
        cat.Catalog.from_bytes(cat.encode(columns, strings, meta, frame_size=frame_size))


def test_partitions_are_balanced_and_spread(tmp_path: Path) -> None:
    src = tmp_path / "src"
    rng = np.random.default_rng(3)
    sizes = rng.integers(1000, 50000, 600)
    for i, size in enumerate(sizes):
        d = src / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.bin").write_bytes(rng.bytes(int(size)))
    image = prepare(src, tmp_path / "img", "--partitions", "24")
    c, _ = cat.Catalog.load(image)
    spread = int(c.part_size.max() - c.part_size.min())
    assert spread <= int(sizes.max())  # greedy least-filled: within one file
    for d in ("class0", "class1", "class2"):
        entry = c.resolve(d.encode())
        assert entry is not None
        parts = {int(c.part[e]) for e in c.children(entry)}
        assert len(parts) == 24  # every directory spread over all partitions


def test_prepare_is_deterministic_across_jobs(awkward_src: Path, tmp_path: Path) -> None:
    a = prepare(awkward_src, tmp_path / "a", "--jobs", "1", "--compress", "zstd")
    b = prepare(awkward_src, tmp_path / "b", "--jobs", "4", "--compress", "zstd")
    ca, _ = cat.Catalog.load(a)
    cb, _ = cat.Catalog.load(b)
    for name, _dtype in cat.ENTRY_COLUMNS + cat.PARTITION_COLUMNS:
        assert np.array_equal(getattr(ca, name), getattr(cb, name)), name
    assert ca.dicts and ca.dicts == cb.dicts  # dictionaries trained the same way too
    for p in range(ca.n_partitions):
        assert (a / cat.partition_name(p)).read_bytes() == (b / cat.partition_name(p)).read_bytes()


def test_default_partition_count() -> None:
    assert default_partitions(0, 0) == 1
    assert default_partitions(10 << 20, 5) == 5
    assert default_partitions(10 << 20, 5000) == 16
    assert default_partitions(100 << 30, 10**6) == 1024
    assert default_partitions(5 << 30, 10**5) == 80


def test_zstd_stores_raw_when_it_does_not_pay(awkward_src: Path, tmp_path: Path) -> None:
    c, _ = cat.Catalog.load(prepare(awkward_src, tmp_path / "z", "--compress", "zstd"))
    text = c.resolve(b"sizes/compressible-1m.txt")
    noise = c.resolve(b"sizes/exact-4096.bin")
    assert text is not None and noise is not None
    assert int(c.codec[text]) == cat.CODEC_ZSTD and int(c.stored_len[text]) < 100_000
    assert int(c.codec[noise]) == cat.CODEC_RAW and int(c.stored_len[noise]) == 4096


def test_prepare_leaves_no_worker_processes(awkward_src: Path, tmp_path: Path) -> None:
    import multiprocessing

    from fanfs.prepare import prepare as run_prepare

    summary = run_prepare(awkward_src, tmp_path / "img", jobs=2)
    assert summary.files > 200
    assert multiprocessing.active_children() == []  # every worker was told to stop and did
