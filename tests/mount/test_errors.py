"""Mount tier: every bad input that reaches a mount (a broken image, a wrong mount point, a
corrupt byte, a daemon killed or stopped) gets one clear line and its documented exit code, and
loses nothing. Bad input that needs no mount: tests/unit/test_bad_input.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from catalogs import flip_stored_byte
from conftest import Mount, assert_one_line_error, fanfs, mounted, prepare, wait_until

from fanfs import mounts
from fanfs.errors import ExitCode
from fanfs.image import catalog as cat

# -- broken images: refused before anything is mounted ---------------------------------------


def _rewrite_header(image: Path, **changes: int) -> None:
    path = image / cat.CATALOG_NAME
    data = bytearray(path.read_bytes())
    fields = list(cat.HEADER.unpack_from(data))
    names = ["magic", "version", "header_crc", "n_entries", "n_partitions", "flags"]
    for name, value in changes.items():
        fields[names.index(name)] = value
    fields[2] = 0
    fields[2] = zlib.crc32(cat.HEADER.pack(*fields))
    data[: cat.HEADER.size] = cat.HEADER.pack(*fields)
    path.write_bytes(bytes(data))


def _flip_catalog_body(image: Path) -> None:
    path = image / cat.CATALOG_NAME
    data = bytearray(path.read_bytes())
    data[cat.HEADER.size + 3] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate_catalog(image: Path) -> None:
    path = image / cat.CATALOG_NAME
    path.write_bytes(path.read_bytes()[:-10])


# Each damage, and the words its one line must hold: what is wrong and where. The two images
# that are not one say which of the two ways (no directory, or one without a catalog).
BROKEN = {
    "missing image": (lambda img: shutil.rmtree(img), ("not a fanfs image", "no such directory")),
    "no catalog": (
        lambda img: (img / cat.CATALOG_NAME).unlink(),
        ("not a fanfs image", f"(no {cat.CATALOG_NAME})"),
    ),
    "corrupt catalog": (_flip_catalog_body, ("corrupt catalog", cat.CATALOG_NAME)),
    "truncated catalog": (_truncate_catalog, ("truncated catalog", cat.CATALOG_NAME)),
    "unknown version": (lambda img: _rewrite_header(img, version=99), ("version 99",)),
    "missing partition": (
        lambda img: (img / cat.partition_name(2)).unlink(),
        ("partition missing", cat.partition_name(2)),
    ),
    "truncated partition": (
        lambda img: os.truncate(img / cat.partition_name(1), 10),
        ("partition truncated", cat.partition_name(1), "(10 bytes"),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_image_is_refused_before_mounting(
    small_image: Path, tmp_path: Path, case: str
) -> None:
    damage, words = BROKEN[case]
    damage(small_image)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = fanfs("mount", small_image, mnt, "--local", tmp_path / "local", timeout=30)
    assert_one_line_error(done, ExitCode.IMAGE, *words)
    assert mounts.find(mnt) is None
    assert not (tmp_path / "local").exists()
    # `info` refuses it the same way (it checks the partitions' sizes too).
    assert_one_line_error(fanfs("info", small_image), ExitCode.IMAGE, *words)


# -- mount points -----------------------------------------------------------------------------


def test_mountpoint_missing(small_image: Path, tmp_path: Path) -> None:
    done = fanfs("mount", small_image, tmp_path / "nope", "--local", tmp_path / "l")
    assert_one_line_error(done, ExitCode.MOUNTPOINT, "does not exist")


def test_mountpoint_not_a_directory(small_image: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    done = fanfs("mount", small_image, tmp_path / "file", "--local", tmp_path / "l")
    assert_one_line_error(done, ExitCode.MOUNTPOINT, "not a directory")


def test_mountpoint_already_mounted(small_image: Path, tmp_path: Path) -> None:
    with mounted(small_image, tmp_path / "mnt", tmp_path / "l1"):
        done = fanfs("mount", small_image, tmp_path / "mnt", "--local", tmp_path / "l2")
        assert_one_line_error(done, ExitCode.MOUNTPOINT, "already mounted")
        assert not (tmp_path / "l2").exists()


# -- corruption inside a partition: EIO for that file only ------------------------------------


def test_corrupt_byte_gives_eio_for_that_file_only(small_src: Path, tmp_path: Path) -> None:
    for codec in ("none", "zstd"):
        image = prepare(small_src, tmp_path / f"img-{codec}", "--compress", codec)
        c, victim = flip_stored_byte(image, b"c1/f5.bin")

        verify = fanfs("verify", image)
        assert verify.returncode == ExitCode.FAILED
        assert verify.stdout.splitlines() == [
            f"c1/f5.bin: checksum mismatch (partition {int(c.part[victim])})"
        ]

        with mounted(image, tmp_path / f"mnt-{codec}", tmp_path / f"local-{codec}") as m:
            for _ in range(2):  # stays EIO, and is logged once
                with pytest.raises(OSError) as err:
                    (m.mountpoint / "c1/f5.bin").read_bytes()
                assert err.value.errno == 5
            for f in small_src.rglob("*.bin"):
                if f.name != "f5.bin":
                    assert (m.mountpoint / f.relative_to(small_src)).read_bytes() == f.read_bytes()
            assert m.log_text().count("EIO for /c1/f5.bin") == 1


def _evict(directory: Path) -> None:
    """Drop one directory's files from the page cache (written back first: dirty pages stay)."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_native_pool_serves_cold_files_and_refuses_a_corrupt_one(
    small_src: Path, tmp_path: Path
) -> None:
    """Whole-file reads of raw files that are not in the page cache go to the native read
    pool (the front's threads, or jobs Python hands it: C reads, checks the CRC and replies):
    every byte must still match, and a corrupt file must still be EIO, logged once, with every
    other file readable."""
    for size in (200_000, 1 << 20, 3 << 20):  # one READ each for the first two, not the last
        (small_src / f"big{size}.bin").write_bytes(os.urandom(size))
    image = prepare(small_src, tmp_path / "img", "--compress", "none", "--partitions", "4")
    c, _ = cat.Catalog.load(image)
    victim = c.resolve(b"c2/f6.bin")
    assert victim is not None
    with mounted(image, tmp_path / "mnt", tmp_path / "local", "--keep-local") as m:

        def status() -> dict[str, Any]:
            return dict(json.loads(os.getxattr(m.mountpoint, "user.fanfs.status")))

        def answered() -> int:  # READs the pool answered: the front's, and Python's jobs
            s = status()
            return int(s["front"]["reads"]) + int(s["reader"]["native_jobs"])

        assert wait_until(lambda: status()["store"]["staging_done"], timeout=30)
        # --keep-local names the staged copies, so the test can reach the daemon's own file.
        local = Path(status()["store"]["local_dir"])
        assert status()["native_read_pool"]
        assert status()["native_crc32"] == "isa-l"  # tools/setup_system.sh installs libisal2
        staged = local / cat.partition_name(int(c.part[victim]))
        with open(staged, "r+b") as f:  # the staged copy goes bad after staging checked it
            f.seek(int(c.data_off[victim]) + 10)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x55]))
        _evict(local)
        before = answered()
        for _ in range(2):
            with pytest.raises(OSError) as err:
                (m.mountpoint / "c2/f6.bin").read_bytes()
            assert err.value.errno == errno.EIO
        # The pool answered it (a second time if the read came before its error record did).
        assert 1 <= answered() - before <= 2, status()
        for f in small_src.rglob("*.bin"):
            if f.name != "f6.bin":
                assert (m.mountpoint / f.relative_to(small_src)).read_bytes() == f.read_bytes()
        assert answered() - before > 2  # not all neighbours came with readahead
        assert wait_until(lambda: "EIO for /c2/f6.bin: checksum mismatch" in m.log_text())
        assert m.log_text().count("EIO for /c2/f6.bin") == 1


# -- umount never hangs -----------------------------------------------------------------------


def test_umount_removes_mount_daemon_and_staged_data(small_image: Path, tmp_path: Path) -> None:
    m = Mount(small_image, tmp_path / "mnt", tmp_path / "local")
    try:
        assert fanfs("status", m.mountpoint, "--json").returncode == 0
        done = fanfs("umount", m.mountpoint)
        assert done.returncode == 0, done.stderr
        assert m.proc.wait(5) == 0
        assert mounts.find(m.mountpoint) is None
        assert not (tmp_path / "local").exists()
    finally:
        m.stop()


def test_keep_local_keeps_the_staged_copies(small_image: Path, tmp_path: Path) -> None:
    with mounted(small_image, tmp_path / "mnt", tmp_path / "local", "--keep-local") as m:
        assert fanfs("umount", m.mountpoint).returncode == 0
    (staging,) = (tmp_path / "local").iterdir()
    assert staging.name.startswith("fanfs-stage-") and staging.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in staging.iterdir()) == [cat.partition_name(p) for p in range(4)]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in staging.iterdir())


def test_umount_after_the_daemon_was_killed(small_image: Path, tmp_path: Path) -> None:
    with mounted(small_image, tmp_path / "mnt", tmp_path / "local") as m:
        m.proc.kill()
        m.proc.wait(10)
        assert mounts.find(m.mountpoint) is not None  # a stale mount, as a crash leaves it
        done = fanfs("umount", m.mountpoint, timeout=30)
        assert done.returncode == 0, done.stderr
        assert mounts.find(m.mountpoint) is None


def test_umount_frees_readers_of_a_stopped_daemon(
    small_image: Path, tmp_path: Path, fusectl: None
) -> None:
    """A stopped (or hung) daemon: `fanfs umount` aborts its connection, so a reader waiting on
    it gets an error at once instead of waiting for ever, and the mount is gone."""
    with mounted(small_image, tmp_path / "mnt", tmp_path / "local") as m:
        victim = next(p for p in m.mountpoint.rglob("*") if p.is_file())  # dentries known
        os.kill(m.proc.pid, signal.SIGSTOP)
        outcome: list[BaseException | bytes] = []

        def read() -> None:
            try:
                outcome.append(victim.read_bytes())
            except OSError as e:
                outcome.append(e)

        try:
            reader = threading.Thread(target=read, daemon=True)  # never joined if it hangs
            reader.start()
            time.sleep(1)
            assert outcome == []  # waiting on the stopped daemon
            started = time.monotonic()
            done = fanfs("umount", m.mountpoint, timeout=60)
            assert done.returncode == 0, done.stderr
            reader.join(10)
            assert len(outcome) == 1 and isinstance(outcome[0], OSError), outcome
            assert outcome[0].errno in (errno.ENOTCONN, errno.ECONNABORTED), outcome
            assert time.monotonic() - started < 15
            assert mounts.find(m.mountpoint) is None
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)


def test_sigterm_unmounts_and_cleans_up(small_image: Path, tmp_path: Path) -> None:
    with mounted(small_image, tmp_path / "mnt", tmp_path / "local") as m:
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(30) == 0
        assert mounts.find(m.mountpoint) is None
        assert not (tmp_path / "local").exists()


def test_failures_are_heard_while_reads_never_stop(small_src: Path, tmp_path: Path) -> None:
    """A reader that opens files back to back keeps the daemon's session loop busy without a
    pause (each open is a request its poll catches). The native pool's failure records, which
    trio hears on a pipe, must still get through at once: the corrupt file is counted bad
    while the reads go on."""
    image = prepare(small_src, tmp_path / "img", "--compress", "none", "--partitions", "4")
    flip_stored_byte(image, b"c1/f5.bin", at=10)
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:

        def bad_files() -> int:
            return int(json.loads(os.getxattr(m.mountpoint, mounts.STATUS_XATTR))["reader"]
                       ["bad_files"])  # fmt: skip

        files = [str(p) for p in m.mountpoint.rglob("*.bin") if p.name != "f5.bin"]
        loop = ("import sys\nfiles = sys.argv[1:]\nwhile True:\n    for f in files:\n"
                "        open(f, 'rb').read()\n")  # fmt: skip
        reader = subprocess.Popen([sys.executable, "-c", loop, *files])
        try:
            time.sleep(0.5)
            assert reader.poll() is None  # reading, warm, as fast as it can
            with pytest.raises(OSError) as err:
                (m.mountpoint / "c1/f5.bin").read_bytes()
            assert err.value.errno == errno.EIO
            # Watched in the log, not through the mount (a status request would give trio a
            # turn of its own).
            assert wait_until(lambda: "EIO for /c1/f5.bin" in m.log_text(), timeout=10)
            assert reader.poll() is None  # and the reads went on all along
            assert bad_files() == 1
        finally:
            reader.kill()
            reader.wait()
