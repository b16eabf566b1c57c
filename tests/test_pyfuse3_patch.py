"""Mount tier: fanfs's patch of pyfuse3 (tools/install_pyfuse3.py), on its own.

A five-file system written on pyfuse3 alone (tests/tinyfs.py), mounted for real: with no_open,
`read` gets the inode for file handle 0; a handler that returns a tuple hands the request to
the C function registered with `set_read_hook`, which answers it (byte for byte, also for many
readers at once); a tuple the hook does not take is EIO for that read, the mount goes on; the
session loop takes queued requests itself (its spin counters move)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import json
import os
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
from conftest import wait_until

from fanfs import mounts
from fanfs.node import fuse_ops

TINYFS = Path(__file__).resolve().parent / "tinyfs.py"


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    backing = tmp_path / "backing"
    data = np.random.default_rng(5).bytes((3 << 20) + 12345)
    backing.write_bytes(data)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, TINYFS, backing, mnt], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert wait_until(lambda: mounts.find(mnt) is not None, 10)
        yield mnt, data
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], timeout=10, check=False)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        assert mounts.find(mnt) is None


def test_the_build_is_the_patched_one() -> None:
    assert pyfuse3.FANFS_PATCH == fuse_ops.PATCH_LEVEL  # type: ignore[attr-defined]
    assert fuse_ops.PATCHED and fuse_ops.READ_HOOK


def test_reads_get_the_inode_and_the_hook_answers(tiny: tuple[Path, bytes]) -> None:
    mnt, data = tiny
    whoami = mnt / "whoami"
    assert int(whoami.read_bytes().strip()) == os.stat(whoami).st_ino  # handle 0 -> inode
    assert (mnt / "plain").read_bytes() == bytes(range(256)) * 1000
    assert (mnt / "hooked").read_bytes() == data  # answered by C threads, in 128 KiB READs
    with open(mnt / "hooked", "rb", buffering=0) as f:
        f.seek(1 << 20)
        assert f.read(5000) == data[1 << 20 : (1 << 20) + 5000]


def test_a_tuple_no_hook_takes_is_eio_and_the_mount_goes_on(tiny: tuple[Path, bytes]) -> None:
    mnt, _ = tiny
    with pytest.raises(OSError) as e:
        (mnt / "broken").read_bytes()
    assert e.value.errno == errno.EIO
    assert (mnt / "plain").read_bytes()[:3] == b"\x00\x01\x02"


def test_many_readers_at_once_are_all_answered(tiny: tuple[Path, bytes]) -> None:
    mnt, data = tiny

    def read(i: int) -> bool:
        with open(mnt / ("hooked" if i % 2 else "plain"), "rb", buffering=0) as f:
            f.seek(i * 4096)
            want = data if i % 2 else bytes(range(256)) * 1000
            return f.read(65536) == want[i * 4096 : i * 4096 + 65536]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, range(400)))
    caught = json.loads((mnt / "spins").read_bytes())[0]
    assert caught > 0  # requests taken straight from the fd, without a wait through trio


def test_the_spin_stops_while_every_core_is_wanted_and_comes_back(
    tiny: tuple[Path, bytes],
) -> None:
    """Requests while more threads want a CPU than there are cores (a loader's workers decoding
    between two requests): a spin would take a core from someone, so the loop does not spin.
    Once the cores are free again it spins, and catches back-to-back requests."""
    mnt, _ = tiny

    def spins() -> list[int]:
        with open(mnt / "spins", "rb", buffering=0) as f:  # not cached: a READ each time
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return [int(n) for n in json.loads(f.read(4096))]

    fd = os.open(mnt / "plain", os.O_RDONLY)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 * (os.cpu_count() or 2))]  # fmt: skip
    try:

        def ask() -> None:  # an ioctl reaches the daemon every time (libfuse answers it)
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, termios.TCGETS, bytes(64))

        time.sleep(0.3)  # the kernel's CPU pressure rises
        before = spins()
        for _ in range(200):
            ask()
            time.sleep(0.003)
        slow = [a - b for a, b in zip(spins(), before, strict=True)]
        assert slow[3] >= 150, slow  # mostly not tried
        for p in burners:
            p.kill()
            p.wait()
        time.sleep(0.3)  # the pressure falls (the loop reads the kernel's figure every 100 ms)
        for _ in range(400):
            ask()
            time.sleep(0.0002)  # within the spin's window, but after the loop is back to it
        fast = [a - b for a, b in zip(spins(), before, strict=True)]
        assert fast[0] - slow[0] > 100, (slow, fast)  # spins again, and catches them
    finally:
        os.close(fd)
        for p in burners:
            p.kill()
            p.wait()
