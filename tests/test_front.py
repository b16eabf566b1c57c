"""Mount tier: the front (fanfs/csrc/front.c), C threads that take requests from the FUSE device.

Through a real mount: lookups, attributes, reads of staged files and terminal checks are
answered with no request reaching Python (the daemon's status counts what the front answered
and what it forwarded), every byte is the source's, files looked up are read ahead into the
pool's cache and their READs find them, a stat walk stops the reads ahead, the leader polls
for the next request only while a core is free, and with the front off (FANFS_FRONT=0)
pyfuse3's loop answers everything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import Mount, mounted, prepare

N_FILES = 120


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Raw files of 1 to 300 KiB in 4 directories, and their image."""
    base = tmp_path_factory.mktemp("front")
    rng = np.random.default_rng(3)
    for i in range(N_FILES):
        path = base / "src" / f"d{i % 4}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(int(rng.integers(1, 300 << 10))))
    return base / "src", prepare(base / "src", base / "img", "--compress", "none",
                                 "--partitions", "3")  # fmt: skip


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))


def forwarded(m: Mount) -> int:
    """Requests the front forwarded to Python so far (asking forwards a few itself: the status
    is an extended attribute, which Python answers)."""
    return int(m.status()["front"]["forwarded"])


def forwarded_by(m: Mount, action: object) -> int:
    """Requests forwarded while `action()` ran, those of asking for the status left out."""
    first = forwarded(m)
    asking = forwarded(m) - first
    before = forwarded(m)
    action()  # type: ignore[operator]
    return forwarded(m) - before - asking


def read_all(src: Path, mnt: Path) -> None:
    for f in files(src):
        with open(mnt / f.relative_to(src), "rb", buffering=0) as g:
            assert g.read() == f.read_bytes(), f


def test_lookups_attributes_and_reads_never_reach_python(tree: tuple[Path, Path],
                                                         tmp_path: Path) -> None:  # fmt: skip
    src, image = tree
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        read_all(src, m.mountpoint)
        st = m.status()
        front = st["front"]
        assert front["running"] and front["lookups"] >= N_FILES + 4, front
        assert front["reads"] >= N_FILES - 3, front
        # Python saw only the first READ of each partition (which hands the C its fds).
        assert st["reader"]["reads"] <= 3, st["reader"]
        # Every file was looked up, then read: read ahead at its LOOKUP, and that was used.
        assert front["lookahead_started"] >= N_FILES // 2, front
        assert front["lookahead_used"] >= front["lookahead_started"] - 3, front
        assert front["lookahead_unused"] == 0, front

        def stat_again() -> None:  # attributes and lookups again: none reaches Python
            for f in files(src)[:10]:
                assert (m.mountpoint / f.relative_to(src)).stat().st_size == f.stat().st_size

        assert forwarded_by(m, stat_again) == 0


def test_a_terminal_check_is_answered_by_the_front(tree: tuple[Path, Path],
                                                   tmp_path: Path) -> None:  # fmt: skip
    src, image = tree
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        rel = files(src)[0].relative_to(src)
        fd = os.open(m.mountpoint / rel, os.O_RDONLY)
        try:
            others = m.status()["front"]["others"]

            def ask() -> None:
                for _ in range(20):
                    with pytest.raises(OSError) as err:
                        fcntl.ioctl(fd, termios.TCGETS, bytes(64))
                    assert err.value.errno == errno.ENOTTY

            assert forwarded_by(m, ask) == 0
            assert m.status()["front"]["others"] - others >= 20
        finally:
            os.close(fd)


def test_a_stat_walk_stops_the_reads_ahead(tree: tuple[Path, Path], tmp_path: Path) -> None:
    """`ls -l` or `du` looks every file up and reads none: after a few, nothing is read
    ahead any more; reads that follow lookups bring it back."""
    src, image = tree
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        for f in files(src):
            os.stat(m.mountpoint / f.relative_to(src))
        front = m.status()["front"]
        assert front["lookups"] >= N_FILES
        assert front["lookahead_started"] < N_FILES // 2, front
        assert front["lookahead_used"] == 0


def test_with_the_front_off_the_event_loop_answers_everything(
    tree: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, image = tree
    monkeypatch.setenv("FANFS_FRONT", "0")
    m = Mount(image, tmp_path / "mnt", tmp_path / "local")
    try:
        m.wait_staged()
        read_all(src, m.mountpoint)
        st = m.status()
        assert not st["front"]["running"] and st["front"]["lookups"] == 0
    finally:
        m.stop()


def test_the_leader_polls_only_while_a_core_is_free(tree: tuple[Path, Path],
                                                    tmp_path: Path) -> None:  # fmt: skip
    """Requests 0.2 ms apart: the leader's poll catches them (it seldom sleeps). The same
    while more threads want a CPU than there are cores (a loader's workers decoding between
    two requests): a poll would take a core from someone, so it sleeps after each."""
    src, image = tree
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        fd = os.open(m.mountpoint / files(src)[0].relative_to(src), os.O_RDONLY)

        def sleeps_over(n: int, gap_s: float) -> int:
            before = m.status()["front"]["waits"]
            for _ in range(n):
                with contextlib.suppress(OSError):  # ENOTTY, answered by the front
                    fcntl.ioctl(fd, termios.TCGETS, bytes(64))
                time.sleep(gap_s)
            return int(m.status()["front"]["waits"]) - before - 1  # less the status call

        burners: list[subprocess.Popen[bytes]] = []
        try:
            time.sleep(0.3)  # an idle machine: no CPU pressure
            idle = sleeps_over(300, 0.0002)
            burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                       for _ in range(2 * (os.cpu_count() or 2))]  # fmt: skip
            time.sleep(0.3)  # the kernel's CPU pressure rises
            busy = sleeps_over(200, 0.003)
        finally:
            os.close(fd)
            for p in burners:
                p.kill()
                p.wait()
        assert idle < 100 and busy > 150, (idle, busy)
