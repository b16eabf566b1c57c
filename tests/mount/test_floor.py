"""Mount tier: the FUSE floor (fanfs/bench/floor.c, `fanfs bench --against floor`), the least
a FUSE file system does, which the bench measures beside fanfs.

Built with the machine's compiler and mounted for real, each way it takes requests (libfuse's
threads, one polling thread): it serves its source byte for byte (nested directories, an empty
file, a symlink, a file of several READs), refuses writes, drops the kernel's pages of its files
when the bench makes a pass cold (counted with mincore), leaves no mount or process behind, and
says why when it cannot start.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fanfs import mounts
from fanfs.bench import compare, floor
from fanfs.errors import FanfsError

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]

LIBC = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not floor.available():
        pytest.fail("no C compiler or libfuse3 headers: tools/setup_system.sh installs them")
    return floor.build(tmp_path_factory.mktemp("floor"))


@pytest.fixture(params=[False, True], ids=["threads", "poll"])
def served(request: pytest.FixtureRequest, exe: Path, tmp_path: Path
           ) -> Iterator[tuple[Path, floor.Floor]]:  # fmt: skip
    src = tmp_path / "src"
    rng = np.random.default_rng(5)
    for i in range(12):
        p = src / f"d{i % 3}" / "deeper" / f"f{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.bytes(int(rng.integers(1, 300 << 10))))
    (src / "empty").write_bytes(b"")
    (src / "big.bin").write_bytes(rng.bytes((3 << 20) + 7))  # several READs
    (src / "link").symlink_to("d0/deeper/f0.bin")
    fl = floor.Floor(exe, src, tmp_path / "mnt", request.param)
    try:
        yield src, fl
    finally:
        fl.stop()
    assert mounts.find(tmp_path / "mnt") is None


def test_a_floor_that_cannot_start_says_why(exe: Path, tmp_path: Path) -> None:
    with pytest.raises(FanfsError, match=r"fanfs-floor did not mount .*No such file"):
        floor.Floor(exe, tmp_path / "missing", tmp_path / "mnt", False)
    assert mounts.find(tmp_path / "mnt") is None


def resident_pages(path: Path) -> int:
    """How many of `path`'s pages the kernel holds (mincore), mapping it without reading it."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)
        pages = (len(m) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        rc = LIBC.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(len(m)), vec)
        del view  # the map cannot close while a view of it exists
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


def test_the_floor_serves_its_source_and_nothing_else(served: tuple[Path, floor.Floor]) -> None:
    src, fl = served
    assert compare.assert_same_tree(src, fl.mountpoint) == 14
    for target in (fl.mountpoint / "new", fl.mountpoint / "big.bin"):
        with pytest.raises(OSError) as e:
            os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
        assert e.value.errno == errno.EROFS, target


def test_a_cold_pass_finds_none_of_the_floors_pages(served: tuple[Path, floor.Floor]) -> None:
    src, fl = served
    big = fl.mountpoint / "big.bin"
    assert compare.same_bytes(bytes(src / "big.bin"), bytes(big))
    assert resident_pages(big) == (big.stat().st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fl.cold()
    assert resident_pages(big) == 0
    compare.assert_same_tree(src, fl.mountpoint)  # and read again, the same bytes
    assert resident_pages(big) > 0
    pid = fl.pid()
    fl.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
