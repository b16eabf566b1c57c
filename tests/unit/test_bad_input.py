"""Unit tier: bad input that needs no mount gets one clear line and its documented exit code,
and loses nothing: prepare's sources and targets, a catalog that is garbage, `wait` and
`umount` where nothing is mounted. (Broken images refused by `mount`, and mount points:
tests/mount/test_errors.py.)"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
from conftest import FANFS, assert_one_line_error, fanfs

from fanfs.errors import ExitCode
from fanfs.image import catalog as cat


def no_leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_prepare_missing_source(tmp_path: Path) -> None:
    done = fanfs("prepare", tmp_path / "nope", tmp_path / "img")
    assert_one_line_error(done, ExitCode.SOURCE, "nope")
    assert not (tmp_path / "img").exists()


def test_prepare_source_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    done = fanfs("prepare", tmp_path / "file", tmp_path / "img")
    assert_one_line_error(done, ExitCode.SOURCE, "not a directory")


def test_prepare_unreadable_file_leaves_nothing(small_src: Path, tmp_path: Path) -> None:
    bad = small_src / "c2" / "f2.bin"
    bad.chmod(0)
    # Root reads anything; dropping the DAC override capabilities makes "unreadable" real.
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    done = subprocess.run(
        [*drop, *FANFS, "prepare", str(small_src), str(tmp_path / "img")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert_one_line_error(done, ExitCode.SOURCE, "f2.bin", "Permission denied")
    assert not (tmp_path / "img").exists()
    assert no_leftovers(tmp_path) == []


def test_prepare_refuses_existing_image_unless_forced(small_src: Path, small_image: Path) -> None:
    before = (small_image / cat.CATALOG_NAME).read_bytes()
    done = fanfs("prepare", small_src, small_image)
    assert_one_line_error(done, ExitCode.SOURCE, "already exists", "--force")
    assert (small_image / cat.CATALOG_NAME).read_bytes() == before
    (small_src / "added.txt").write_text("new")
    done = fanfs("prepare", small_src, small_image, "--force")
    assert done.returncode == 0, done.stderr
    assert cat.Catalog.load(small_image)[0].resolve(b"added.txt") is not None
    assert no_leftovers(small_image.parent) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_prepare_interrupted_leaves_nothing(awkward_src: Path, tmp_path: Path, sig: int) -> None:
    image = tmp_path / "img"
    # Slow enough to interrupt: the strongest zstd level on the 64 MiB file.
    proc = subprocess.Popen(
        [*FANFS, "prepare", str(awkward_src), str(image), "--compress", "zstd:19"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not any(".partial-" in p.name for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert not image.exists()
    assert no_leftovers(tmp_path) == []


def test_prepare_skips_special_files_with_a_warning(small_src: Path, tmp_path: Path) -> None:
    os.mkfifo(small_src / "a-fifo")
    done = fanfs("prepare", small_src, tmp_path / "img")
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "a-fifo" in line and "WARNING" in line]
    assert cat.Catalog.load(tmp_path / "img")[0].resolve(b"a-fifo") is None


def test_prepare_bad_compress_value(small_src: Path, tmp_path: Path) -> None:
    done = fanfs("prepare", small_src, tmp_path / "img", "--compress", "lz4")
    assert_one_line_error(done, ExitCode.USAGE, "lz4")


def test_header_rejects_garbage(tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    (img / cat.CATALOG_NAME).write_bytes(b"not a catalog at all" * 10)
    done = fanfs("info", img)
    assert_one_line_error(done, ExitCode.IMAGE, "bad magic")
    (img / cat.CATALOG_NAME).write_bytes(struct.pack("<8s", cat.MAGIC))
    assert_one_line_error(fanfs("info", img), ExitCode.IMAGE, "truncated")


def test_wait_times_out_on_an_unmounted_directory(tmp_path: Path) -> None:
    started = time.monotonic()
    done = fanfs("wait", tmp_path, "--timeout", "0.5")
    assert_one_line_error(done, ExitCode.TIMEOUT, "not serving")
    assert time.monotonic() - started < 10


def test_umount_of_nothing(tmp_path: Path) -> None:
    assert_one_line_error(fanfs("umount", tmp_path), ExitCode.MOUNTPOINT, "no fanfs mount")
