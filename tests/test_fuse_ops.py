"""Adapter tier: FanfsOperations called directly under trio, no kernel in between."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import parts
import pyfuse3
import pytest

from fanfs import catalog as cat
from fanfs.node.fuse_ops import ROOT, FanfsOperations
from fanfs.node.store import PartitionStore


@pytest.fixture
def ops(awkward_image: Path, tmp_path: Path) -> Iterator[FanfsOperations]:
    c, _ = cat.Catalog.load(awkward_image)
    store = PartitionStore(awkward_image, c, tmp_path / "local", range(c.n_partitions))
    try:
        yield FanfsOperations(c, parts.reader(c, store), lambda: {"serving": True})
    finally:
        store.close()


CTX = pyfuse3.RequestContext()


async def test_lookup_getattr_read(ops: FanfsOperations, awkward_src: Path) -> None:
    sizes = await ops.lookup(ROOT, b"sizes", CTX)
    assert stat.S_ISDIR(sizes.st_mode)
    f = await ops.lookup(sizes.st_ino, b"exact-131072.bin", CTX)
    want = (awkward_src / "sizes/exact-131072.bin").read_bytes()
    assert f.st_size == len(want) and f.entry_timeout > 86400
    assert bytes(await ops.read(f.st_ino, 1000, 5000)) == want[1000:6000]
    assert bytes(await ops.read(f.st_ino, len(want) - 10, 5000)) == want[-10:]
    assert await ops.read(f.st_ino, len(want) + 1, 10) == b""
    assert (await ops.getattr(f.st_ino, CTX)).st_mtime_ns == os.stat(
        awkward_src / "sizes/exact-131072.bin"
    ).st_mtime_ns


async def test_negative_lookup_is_cached(ops: FanfsOperations) -> None:
    missing = await ops.lookup(ROOT, b"missing", CTX)
    assert missing.st_ino == 0 and missing.entry_timeout > 86400


async def test_bad_inode_and_symlink(ops: FanfsOperations) -> None:
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.getattr(10**9, CTX)
    assert err.value.errno == errno.ENOENT
    link = await ops.lookup(ROOT, b"link-to-file", CTX)
    assert await ops.readlink(link.st_ino, CTX) == b"sizes/exact-4096.bin"


async def test_open_and_writes(ops: FanfsOperations) -> None:
    f = await ops.lookup(ROOT, b"empty-file", CTX)
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.open(f.st_ino, os.O_WRONLY, CTX)
    assert err.value.errno == errno.EROFS
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.mkdir(ROOT, b"x", 0o755, CTX)
    assert err.value.errno == errno.EROFS
    assert await ops.getxattr(ROOT, b"user.fanfs.status", CTX) == b'{"serving": true}'
    with pytest.raises(pyfuse3.FUSEError):
        await ops.getxattr(f.st_ino, b"user.fanfs.status", CTX)


async def test_whole_file_requests_are_not_cached(ops: FanfsOperations, awkward_src: Path) -> None:
    sizes = await ops.lookup(ROOT, b"sizes", CTX)
    small = await ops.lookup(sizes.st_ino, b"exact-4096.bin", CTX)
    assert (
        bytes(await ops.read(small.st_ino, 0, 131072))
        == (awkward_src / "sizes/exact-4096.bin").read_bytes()
    )
    assert ops.reader.statistics().cache_bytes == 0  # the kernel keeps it, not us
    mixed = await ops.lookup(sizes.st_ino, b"mixed-300k.bin", CTX)
    want = (awkward_src / "sizes/mixed-300k.bin").read_bytes()
    assert bytes(await ops.read(mixed.st_ino, 0, 131072)) == want[:131072]
    assert ops.reader.statistics().cache_bytes > len(want)  # later chunks come from memory
    assert bytes(await ops.read(mixed.st_ino, 131072, 131072)) == want[131072:262144]
    assert ops.reader.statistics().cache_hits == 1
