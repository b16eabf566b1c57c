"""Mount tier: fanfs's patch of pyfuse3 (tools/install_pyfuse3.py), on its own.

A five-file system written on pyfuse3 alone (tests/tinyfs.py), mounted for real: with no_open,
`read` gets the inode for file handle 0; a handler that returns a tuple hands the request to
the C function registered with `set_read_hook`, which answers it (byte for byte, also for many
readers at once); a tuple the hook does not take is EIO for that read, the mount goes on; with
a receiver registered (`set_receiver`), the session loop takes every request from it and the
file system behaves the same, and unmounting ends the loop."""

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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
from conftest import TESTS, wait_until

from fanfs import mounts
from fanfs.node import fuse_ops

TINYFS = TESTS / "tinyfs.py"


@contextlib.contextmanager
def tinyfs(tmp_path: Path, *extra: str) -> Iterator[tuple[Path, bytes]]:
    backing = tmp_path / "backing"
    data = np.random.default_rng(5).bytes((3 << 20) + 12345)
    backing.write_bytes(data)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, TINYFS, backing, mnt, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
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
        assert proc.returncode == 0


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    with tinyfs(tmp_path) as t:
        yield t


@pytest.fixture
def tiny_receiver(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    with tinyfs(tmp_path, "--receiver") as t:
        yield t


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


def stats(mnt: Path) -> dict[str, int]:
    with open(mnt / "stats", "rb", buffering=0) as f:  # not cached: a READ each time
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return dict(json.loads(f.read(4096)))


def test_with_a_receiver_the_loop_takes_every_request_from_it(
    tiny_receiver: tuple[Path, bytes],
) -> None:
    """fanfs's front, given nothing to answer, hands the session loop every request through the
    receiver: the file system works as without it, under many readers too, and unmounting
    ends the loop (the fixture's teardown waits for the process)."""
    mnt, _ = tiny_receiver
    before = stats(mnt)["forwarded"]
    test_reads_get_the_inode_and_the_hook_answers(tiny_receiver)
    test_many_readers_at_once_are_all_answered(tiny_receiver)
    fd = os.open(mnt / "plain", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:  # libfuse's answer, through the loop
            fcntl.ioctl(fd, termios.TCGETS, bytes(64))
        assert e.value.errno == errno.ENOTTY
    finally:
        os.close(fd)
    after = stats(mnt)
    # Most reads come from the page cache; every request that did come was forwarded.
    assert after["forwarded"] - before > 10 and after["reads"] == after["lookups"] == 0
