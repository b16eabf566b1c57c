"""Adapter tier: fanfsOperations called directly under trio, no kernel in between."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import parts
import pyfuse3
import pytest

from fanfs.image import catalog as cat
from fanfs.node.fuse_ops import ROOT, FanfsOperations
from fanfs.node.store import PartitionStore

if TYPE_CHECKING:
    from fanfs.native import lib


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


# -- the front's catalog answers (fanfs/csrc/front.c) are the adapter's ---------------------


def _front_for(c: cat.Catalog) -> lib.Meta:
    from fanfs.node.front import Front
    from fanfs.node.fuse_ops import BLKSIZE, CACHE_TIMEOUT_S

    mine = np.ones(c.n_partitions, dtype=np.uint8)
    return Front(lambda *a: None, lambda: -1, BLKSIZE, int(CACHE_TIMEOUT_S), mine,
                 0).give_catalog(c)  # fmt: skip


async def test_the_front_looks_up_and_answers_attributes_as_the_adapter_does(
    tmp_path: Path,
) -> None:
    """Every entry of a tree with names that sort awkwardly (prefixes, bytes above 0x7f, the
    longest name, 300 siblings): the C lookup finds what the catalog's finds, misses what it
    misses, and its attributes are the ones the adapter replies with."""
    from conftest import prepare

    src = tmp_path / "src"
    names = [b"a", b"a.b", b"ab", b"a\xff", b"a\x01", b"b", b"A", b"L" * 255, b"caf\xc3\xa9"]
    names += [b"s%03d" % i for i in range(300)]
    for d in (b"", b"sub/", b"sub/deeper/"):
        for n in names:
            path = os.path.join(os.fsencode(src), d + n)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(n * 3)
    os.symlink("a", src / "link")
    with open(src / "sparse", "wb") as f:  # 8 MiB holding 4 KiB: a few blocks, not 16,384
        f.truncate(8 << 20)
        f.seek(4 << 20)
        f.write(b"x" * 4096)
    c, _ = cat.Catalog.load(prepare(src, tmp_path / "img", "--partitions", "2"))
    meta = _front_for(c)
    store = PartitionStore(tmp_path / "img", c, tmp_path / "local", range(c.n_partitions))
    try:
        ops = FanfsOperations(c, parts.reader(c, store), lambda: {})
        for entry in range(c.n_entries):
            a = ops._attrs(entry)
            got = meta.attr(entry)
            assert got == {"ino": a.st_ino, "size": a.st_size, "blocks": a.st_blocks,
                           "mtime": a.st_mtime_ns // 10**9, "mtimensec": a.st_mtime_ns % 10**9,
                           "mode": a.st_mode, "nlink": a.st_nlink, "uid": a.st_uid,
                           "gid": a.st_gid, "blksize": a.st_blksize,
                           "atime": a.st_atime_ns // 10**9,
                           "ctime": a.st_ctime_ns // 10**9}, entry  # fmt: skip
            path = os.path.join(os.fsencode(src), c.path(entry))
            assert a.st_blocks == os.lstat(path).st_blocks, path  # the source's allocation
            if entry:
                parent, name = int(c.parent[entry]), c.name(entry)
                assert meta.lookup(parent, name) == entry
                assert (await ops.lookup(parent + ROOT, name, CTX)).st_ino == entry + ROOT
                for missing in (name + b"\x00x", name[:-1] + b"~", b"zz" + name):
                    if c.lookup(parent, missing) is None:
                        assert meta.lookup(parent, missing) is None, missing
                if not c.is_dir[entry]:
                    assert meta.lookup(entry, b"a") == -1  # not a directory
        assert meta.attr(c.n_entries) is None
        sparse = c.resolve(b"sparse")
        assert sparse is not None and meta.attr(sparse)["blocks"] < (8 << 20) // 512 // 100
    finally:
        store.close()
