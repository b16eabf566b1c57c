"""Mount tier: fault injection: an error at the disk, the codec, a peer or the catalog is EIO (or a
clean refusal) for that one file or image, logged once, and the daemon keeps serving the rest.

The disk is real: the image lives on tests/faultfs.py, a FUSE passthrough that fails reads of
a chosen byte range with a real errno, and staging goes to a tmpfs too small for it, so every
read comes from that image."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from catalogs import columns_of, encode, rewrite
from conftest import TESTS, assert_one_line_error, fanfs, mounted, prepare, teardown, wait_until
from test_mpi import mpi_mounted

from fanfs import mounts, placement
from fanfs.errors import ExitCode
from fanfs.image import catalog as cat

FAULTFS = TESTS / "faultfs.py"
BIG = 20 << 20  # a raw file over the reader's 16 MiB whole-file limit: the path that crashed


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "tiny"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "fanfs-test", disk], check=True,
                   timeout=30)  # fmt: skip
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", disk], check=False, timeout=30)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    for i in range(30):
        (src / f"r{i}.bin").write_bytes(rng.bytes(20_000 + i))
        (src / f"t{i}.txt").write_bytes(b"compressible text %d\n" % i * 900)
    (src / "big.bin").write_bytes(rng.bytes(BIG))
    return src


class FaultyDisk:
    """IMAGE served from a faultfs mount; `arm` makes reads of a stored range fail."""

    def __init__(self, image: Path, base: Path):
        self.mnt = base / "faulty"
        self.mnt.mkdir()
        self.control = base / "fault.json"
        self.control.write_text("{}")
        self.catalog, _ = cat.Catalog.load(image)
        self.proc = subprocess.Popen([sys.executable, str(FAULTFS), str(image), str(self.mnt),
                                      str(self.control)])  # fmt: skip
        if not wait_until(lambda: (self.mnt / cat.CATALOG_NAME).exists(), timeout=20):
            self.stop()
            raise RuntimeError("faultfs did not come up")

    def arm(self, rel: bytes, within: tuple[int, int] = (0, 1), code: int = 5) -> None:
        """Fail reads of bytes [lo, hi) of file `rel`'s stored bytes with errno `code`."""
        c = self.catalog
        e = c.resolve(rel)
        assert e is not None
        start = int(c.data_off[e])
        fault = {"name": cat.partition_name(int(c.part[e])), "lo": start + within[0],
                 "hi": start + within[1], "errno": code}  # fmt: skip
        self.control.write_text(json.dumps(fault))

    def stop(self) -> None:
        teardown(self.proc, [self.mnt], None)


def test_disk_errors_fail_only_that_read_and_the_daemon_serves_on(
    src: Path, tmp_path: Path, tiny_disk: Path
) -> None:
    # Raw, so big.bin takes the large-raw path (compressed, it would be framed).
    image = prepare(src, tmp_path / "img", "--partitions", "3", "--compress", "none")
    disk = FaultyDisk(image, tmp_path)
    try:
        with mounted(disk.mnt, tmp_path / "mnt", tiny_disk) as m:
            assert wait_until(lambda: "staging stopped" in m.log_text(), timeout=30)
            # A large raw file checked at its first read; then the disk fails under a later
            # read of it, far from what the kernel read ahead.
            fd = os.open(m.mountpoint / "big.bin", os.O_RDONLY)
            try:
                assert os.pread(fd, 4096, 0) == (src / "big.bin").read_bytes()[:4096]
                disk.arm(b"big.bin", (12 << 20, 13 << 20))
                with pytest.raises(OSError) as err:
                    os.pread(fd, 4096, 12 << 20)
                assert err.value.errno == 5
            finally:
                os.close(fd)
            # Two small files whose bytes cannot be read at all.
            for rel in (b"r3.bin", b"t4.txt"):
                disk.arm(rel, (0, 10), code=5)
                for _ in range(2):
                    with pytest.raises(OSError) as err:
                        (m.mountpoint / os.fsdecode(rel)).read_bytes()
                    assert err.value.errno == 5
            disk.control.write_text("{}")  # the disk recovers
            # Everything reads, byte for byte, from the same daemon: the files that failed
            # too (a disk's EIO fails that READ alone; only bad bytes make a file bad).
            for f in src.iterdir():
                assert (m.mountpoint / f.name).read_bytes() == f.read_bytes()

            # The native pool reports its failures through a pipe that trio reads between
            # requests: promptly, even while requests keep coming.
            def status() -> dict[str, Any]:
                got: dict[str, Any] = json.loads(os.getxattr(m.mountpoint, mounts.STATUS_XATTR))
                return got

            assert wait_until(lambda: all(f"of /{n} failed" in m.log_text()
                                          for n in ("r3.bin", "t4.txt")), timeout=10)  # fmt: skip
            assert status()["reader"]["bad_files"] == 0 and status()["serving"]
            log = m.log_text()
            assert "EIO for /big.bin (this read only)" in log
            # Each file failed several READs: one warning each (at most one a minute).
            assert all(log.count(f"of /{n} failed") == 1 for n in ("r3.bin", "t4.txt")), log
            assert "Traceback" not in log
    finally:
        disk.stop()


def test_short_reads_fail_only_the_files_they_cut(
    src: Path, tmp_path: Path, tiny_disk: Path
) -> None:
    image = prepare(src, tmp_path / "img", "--partitions", "3", "--compress", "none")
    c, _ = cat.Catalog.load(image)
    victim = c.resolve(b"r7.bin")
    assert victim is not None
    part, cut = int(c.part[victim]), int(c.data_off[victim]) + 100
    cut_off = {int(e) for e in c.files_in_partition(part) if c.data_off[e] + c.stored_len[e] > cut}
    with mounted(image, tmp_path / "mnt", tiny_disk) as m:
        assert wait_until(lambda: "staging stopped" in m.log_text(), timeout=30)
        os.truncate(image / cat.partition_name(part), cut)  # the shared copy loses its tail
        for f in src.iterdir():
            e = c.resolve(f.name.encode())
            if e in cut_off:
                with pytest.raises(OSError) as err:
                    (m.mountpoint / f.name).read_bytes()
                assert err.value.errno == 5
            else:
                assert (m.mountpoint / f.name).read_bytes() == f.read_bytes()
        assert fanfs("status", m.mountpoint).returncode == 0


def test_codec_error_with_a_matching_checksum(src: Path, tmp_path: Path) -> None:
    """A hostile image: garbage where a zstd frame should be, with the CRC of the garbage."""
    image = prepare(src, tmp_path / "img", "--partitions", "3")
    c, _ = cat.Catalog.load(image)
    victim = c.resolve(b"t2.txt")
    assert victim is not None and c.codec[victim] != cat.CODEC_RAW
    start, n = int(c.data_off[victim]), int(c.stored_len[victim])
    garbage = os.urandom(n)
    with open(image / cat.partition_name(int(c.part[victim])), "r+b") as f:
        f.seek(start)
        f.write(garbage)

    def crc(columns: dict[str, np.ndarray], strings: bytes) -> None:
        columns["crc"][victim] = zlib.crc32(garbage)

    rewrite(image, crc)
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        with pytest.raises(OSError) as err:
            (m.mountpoint / "t2.txt").read_bytes()
        assert err.value.errno == 5
        for f in src.iterdir():
            if f.name != "t2.txt":
                assert (m.mountpoint / f.name).read_bytes() == f.read_bytes()
        # Once, by the native pool or by Python's zstd, whichever met it first.
        log = m.log_text()
        assert log.count("EIO for /t2.txt: ") == 1, log
        assert "EIO for /t2.txt: stored bytes do not decode" in log or "t2.txt: zstd" in log


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c, s: c["name_len"].__setitem__(3, 0), "name empty"),
        (lambda c, s: c["mode"].__setitem__(5, 0o020644), "not a directory, file or symlink"),
        (lambda c, s: c["parent"].__setitem__(4, 7), "parent"),
        (lambda c, s: c["stored_len"].__setitem__(6, c["size"][6] - 1), "stored length"),
        (lambda c, s: c["name_off"].__setitem__(9, c["name_off"][8]), "duplicate names"),
        (lambda c, s: c["name_off"].__setitem__(8, c["name_off"][9]), "duplicate names"),
    ],
)
def test_hostile_catalog_is_refused_everywhere(
    src: Path, tmp_path: Path, damage: object, reason: str
) -> None:
    image = prepare(src, tmp_path / "img", "--compress", "none")
    rewrite(image, lambda columns, strings: damage(columns, strings))  # type: ignore[operator]
    for command in (("verify", image), ("info", image)):
        assert_one_line_error(fanfs(*command), ExitCode.IMAGE, reason)
    (tmp_path / "mnt").mkdir()
    done = fanfs("mount", image, tmp_path / "mnt", "--local", tmp_path / "l", timeout=30)
    assert_one_line_error(done, ExitCode.IMAGE, reason)
    assert mounts.find(tmp_path / "mnt") is None


@pytest.mark.mpi
def test_bad_payload_and_silent_peer_are_routed_around(src: Path, tmp_path: Path) -> None:
    image = prepare(src, tmp_path / "img", "--partitions", "6", "--compress", "none")
    c, _ = cat.Catalog.load(image)
    owners = placement.place(c.part_size, c.part_flags, 2)
    theirs = [os.fsdecode(c.path(e)) for e, _ in c.walk()
              if c.is_file[e] and owners[c.part[e]] == (1,) and c.size[e] < BIG]  # fmt: skip
    with mpi_mounted(image, tmp_path / "m", 2, "--keep-local", "--peer-timeout", "2") as m:
        assert wait_until(lambda: m.status(1)["store"]["staging_done"], timeout=30)
        # Rank 1's staged copy of one file goes bad: it sends bad bytes, rank 0 sees the CRC
        # fail and reads the image instead. Correct bytes, no EIO.
        staging = Path(m.status(1)["store"]["local_dir"])
        e = c.resolve(theirs[0].encode())
        assert e is not None
        with open(staging / cat.partition_name(int(c.part[e])), "r+b") as f:
            f.seek(int(c.data_off[e]) + 5)
            f.write(b"\xff\x00\xff")
        subprocess.run(["sync"], check=True)
        assert (m.mnts[0] / theirs[0]).read_bytes() == (src / theirs[0]).read_bytes()
        assert m.status(0)["reader"]["bad_payloads"] == 1
        # Rank 1 stops answering: within the peer timeout rank 0 reads the image instead.
        pid = m.status(1)["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for rel in theirs[1:4]:
                assert (m.mnts[0] / rel).read_bytes() == (src / rel).read_bytes()
            assert time.monotonic() - started < 2 + 10
            assert m.status(0)["reader"]["dead_peers"] == [1]
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("frame_size", [256 << 20, 4096, 0])
def test_a_frame_size_prepare_does_not_write_is_refused(tmp_path: Path, frame_size: int) -> None:
    """A hostile frame size (up to 256 MiB fits the format) would make every decode cost up
    to a GiB in the native pool's buffers: refused at load, as every hostile catalog is."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "framed.bin").write_bytes(bytes(5 << 20))
    image = prepare(src, tmp_path / "img", "--compress", "zstd")
    path = image / cat.CATALOG_NAME
    columns, strings, meta, _ = columns_of(path.read_bytes())
    path.write_bytes(encode(columns, strings, meta, frame_size))
    for command in (("verify", image), ("info", image)):
        assert_one_line_error(fanfs(*command), ExitCode.IMAGE, "frame size")
    (tmp_path / "mnt").mkdir()
    done = fanfs("mount", image, tmp_path / "mnt", "--local", tmp_path / "l", timeout=30)
    assert_one_line_error(done, ExitCode.IMAGE, "frame size")
    assert mounts.find(tmp_path / "mnt") is None


def test_a_fifo_in_place_of_a_partition_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """Someone who can write the image directory swaps a partition for a FIFO after the
    mount checked it: opening it would block the daemon for ever. Its files get EIO. (A
    small --local disk keeps the partition unstaged, so its files are read from the image.)"""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(6000))
    image = prepare(src, tmp_path / "img", "--compress", "none", "--partitions", "2")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "fanfs-test", disk],
                   check=True, timeout=30)  # fmt: skip
    try:
        with mounted(image, tmp_path / "mnt", disk) as m:
            assert wait_until(lambda: m.status()["store"]["staging_stopped"], 30)
            part = image / cat.partition_name(1)
            part.unlink()
            os.mkfifo(part)
            c, _ = cat.Catalog.load(image)
            victims = [os.fsdecode(c.path(int(e))) for e in c.files_in_partition(1)]
            started = time.monotonic()
            for rel in victims[:3]:
                with pytest.raises(OSError) as err:
                    (m.mountpoint / rel).read_bytes()
                assert err.value.errno == errno.EIO
            assert time.monotonic() - started < 10
            assert m.status()["serving"]
    finally:
        subprocess.run(["umount", "-l", disk], check=False, timeout=30)
    assert_one_line_error(fanfs("info", image), ExitCode.IMAGE, "not a regular file")


def test_two_codecs_over_the_same_stored_bytes_decode_apart(tmp_path: Path) -> None:
    """A hostile catalog points two files at the same stored bytes (same offset, length and
    CRC): one as a zstd frame, one as the delta4 filter's zstd frame. Each must decode as its
    own codec says; the native pool's cache of decoded pieces left the codec out of its key,
    so the second file read got the first one's decoding."""
    from fanfs.image import codec

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(6)
    data = rng.integers(0, 7, 3 << 20, dtype=np.uint8).tobytes()  # compressible, 3 MiB
    (src / "a.bin").write_bytes(data)
    (src / "b.bin").write_bytes(data[::-1])
    image = prepare(src, tmp_path / "img", "--compress", "zstd")
    c, _ = cat.Catalog.load(image)
    a, b = c.resolve(b"a.bin"), c.resolve(b"b.bin")
    assert a is not None and b is not None and int(c.codec[a]) == cat.CODEC_ZSTD

    def alias(columns: dict[str, np.ndarray], strings: bytes) -> None:
        for col in ("part", "data_off", "stored_len", "crc"):
            columns[col][b] = columns[col][a]
        columns["codec"][b] = cat.CODEC_ZSTD_DELTA4

    rewrite(image, alias)
    want_b = codec.undelta4(data)  # what b's codec makes of a's stored bytes
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        at = 2 << 20
        with open(m.mountpoint / "a.bin", "rb") as f:  # in parts: the piece is kept
            assert f.read(4096) == data[:4096]
            f.seek(at)
            assert f.read(4096) == data[at : at + 4096]
        with open(m.mountpoint / "b.bin", "rb") as f:
            f.seek(at)
            assert f.read(4096) == want_b[at : at + 4096]
