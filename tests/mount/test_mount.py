"""Mount tier: real mounts of the awkward tree, raw and zstd: what users and their tools see."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import subprocess
import termios
from pathlib import Path

import numpy as np
import pytest
from catalogs import as_version_2
from conftest import Mount, fanfs, mounted, prepare
from PIL import Image

from fanfs.bench.compare import assert_same_tree


def test_tree_reads_back_byte_for_byte(awkward_src: Path, awkward_mount: Mount) -> None:
    n = assert_same_tree(awkward_src, awkward_mount.mountpoint)
    assert n > 200


def test_second_pass_is_served_by_the_kernel(awkward_src: Path, awkward_mount: Mount) -> None:
    mnt = awkward_mount.mountpoint
    rel = "sizes/mixed-300k.bin"
    (mnt / rel).read_bytes()
    before = json.loads(fanfs("status", mnt, "--json").stdout)["reader"]["reads"]
    for _ in range(3):
        assert (mnt / rel).read_bytes() == (awkward_src / rel).read_bytes()
    after = json.loads(fanfs("status", mnt, "--json").stdout)["reader"]["reads"]
    assert after == before  # page cache kept across opens: no request reached the daemon


def test_files_are_not_terminals(awkward_src: Path, awkward_mount: Mount) -> None:
    # Python's open() (3.13 and older) asks every file it opens buffered whether it is a
    # terminal; FUSE sends that ioctl to the daemon, whose answer must be a plain "no".
    rel = "sizes/mixed-300k.bin"
    fd = os.open(awkward_mount.mountpoint / rel, os.O_RDONLY)
    try:
        assert not os.isatty(fd)
        with pytest.raises(OSError) as err:
            fcntl.ioctl(fd, termios.TCGETS, bytes(64))
        assert err.value.errno == errno.ENOTTY
        assert os.read(fd, 1 << 20) == (awkward_src / rel).read_bytes()
    finally:
        os.close(fd)
    with open(awkward_mount.mountpoint / rel, "rb") as f:  # buffered, as PIL and numpy open
        assert f.read() == (awkward_src / rel).read_bytes()


def _run(*cmd: str, cwd: Path | None = None) -> bytes:
    return subprocess.run(cmd, capture_output=True, check=True, timeout=120, cwd=cwd).stdout


def test_ls_find_du_stat_agree(awkward_src: Path, awkward_mount: Mount) -> None:
    mnt = awkward_mount.mountpoint

    def ls(root: Path) -> list[bytes]:
        out = _run("ls", "-lR", "--time-style=full-iso", ".", cwd=root)
        return [line for line in out.splitlines() if not line.startswith(b"total ")]

    assert ls(mnt) == ls(awkward_src)
    fmt = "%P %y %s %m %T@ %l\n"
    assert sorted(_run("find", str(mnt), "-printf", fmt).splitlines()) == sorted(
        _run("find", str(awkward_src), "-printf", fmt).splitlines()
    )
    assert _run("du", "-sb", ".", cwd=mnt) == _run("du", "-sb", ".", cwd=awkward_src)
    names = ["sizes/exact-4096.bin", "modes/script.sh", "link-to-dir", "empty-dir"]
    fmt = "%n %s %a %F %Y %h"
    assert _run("stat", "-c", fmt, *names, cwd=mnt) == _run(
        "stat", "-c", fmt, *names, cwd=awkward_src
    )


def test_sparse_files_stay_sparse_and_old_images_still_mount(tmp_path: Path) -> None:
    """st_blocks through the mount is the source's: a 50 MiB file holding 4 KiB of data shows
    its few blocks to stat and du, and cp --sparse=auto (which looks for holes only where
    st_blocks * 512 < st_size) copies it out sparse. An image of format 2 (no blocks) still
    mounts and reads, its blocks the size rounded up as before."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    sparse = src / "d" / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(50 << 20)
        f.seek(25 << 20)
        f.write(b"\x01" * 4096)
    (src / "dense.bin").write_bytes(os.urandom(10_000))
    os.symlink("d/sparse.bin", src / "link")
    for name in ("d/sparse.bin", "dense.bin"):  # ext4 counts delayed allocations until written
        fd = os.open(src / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    st = os.stat(sparse)
    assert st.st_blocks * 512 < st.st_size // 100, "the test's file system keeps no holes"
    image = prepare(src, tmp_path / "img", "--compress", "none")
    names = ["d/sparse.bin", "dense.bin", "link", "d", "."]
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        mnt = m.mountpoint
        for name in names:
            assert os.lstat(mnt / name).st_blocks == os.lstat(src / name).st_blocks, name
        assert _run("du", "-s", ".", cwd=mnt) == _run("du", "-s", ".", cwd=src)
        copy = tmp_path / "copy.bin"
        _run("cp", "--sparse=auto", str(mnt / "d/sparse.bin"), str(copy))
        assert os.stat(copy).st_blocks * 512 < st.st_size // 100
        assert copy.read_bytes() == sparse.read_bytes()
    as_version_2(image)
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        mnt = m.mountpoint
        for name in names:
            got, want = os.lstat(mnt / name), os.lstat(src / name)
            assert got.st_blocks == (want.st_size + 511) // 512, name
        assert (mnt / "d/sparse.bin").read_bytes() == sparse.read_bytes()
        assert (mnt / "dense.bin").read_bytes() == (src / "dense.bin").read_bytes()
        assert os.readlink(mnt / "link") == "d/sparse.bin"


def test_cat_cp_tar_diff(awkward_src: Path, awkward_mount: Mount, tmp_path: Path) -> None:
    mnt = awkward_mount.mountpoint
    assert _run("cat", str(mnt / "with spaces/a file name with spaces.txt")) == b"spaced out\n"
    _run("cp", "-r", str(mnt), str(tmp_path / "copy"))
    _run("diff", "-r", "--no-dereference", str(awkward_src), str(tmp_path / "copy"))
    _run("diff", "-r", "--no-dereference", str(awkward_src), str(mnt))
    tar_opts = ["--sort=name", "--format=gnu", "--numeric-owner", "-c", "."]
    assert _run("tar", *tar_opts, cwd=mnt) == _run("tar", *tar_opts, cwd=awkward_src)


def test_mmap_numpy_pillow(awkward_src: Path, awkward_mount: Mount) -> None:
    mnt = awkward_mount.mountpoint
    rel = "sizes/exact-131072.bin"
    with open(mnt / rel, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[:] == (awkward_src / rel).read_bytes()
        assert mm[70000:70010] == (awkward_src / rel).read_bytes()[70000:70010]
    assert np.array_equal(
        np.load(mnt / "arrays/field.npy"), np.load(awkward_src / "arrays/field.npy")
    )
    mapped = np.load(mnt / "arrays/field.npy", mmap_mode="r")
    assert np.array_equal(mapped, np.load(awkward_src / "arrays/field.npy"))
    del mapped
    for name in ("noise.png", "noise.jpg"):
        with Image.open(mnt / "images" / name) as a, Image.open(awkward_src / "images" / name) as b:
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_random_offset_reads_of_the_big_file(awkward_src: Path, awkward_mount: Mount) -> None:
    rel = "big/over-64mib.bin"
    size = (awkward_src / rel).stat().st_size
    rng = np.random.default_rng(7)
    with open(awkward_src / rel, "rb") as want, open(awkward_mount.mountpoint / rel, "rb") as got:
        for off in [0, size - 1, size - 5000, *rng.integers(0, size, 20).tolist()]:
            n = int(rng.integers(1, 300000))
            assert os.pread(got.fileno(), n, off) == os.pread(want.fileno(), n, off)
        assert os.pread(got.fileno(), 10, size + 100) == b""


WRITES = {
    "open for writing": lambda p: open(p / "empty-file", "w"),  # noqa: SIM115
    "open for append": lambda p: open(p / "empty-file", "a"),  # noqa: SIM115
    "open read-write": lambda p: open(p / "empty-file", "r+"),  # noqa: SIM115
    "create": lambda p: open(p / "new-file", "x"),  # noqa: SIM115
    "mkdir": lambda p: os.mkdir(p / "new-dir"),
    "rmdir": lambda p: os.rmdir(p / "empty-dir"),
    "unlink": lambda p: os.unlink(p / "empty-file"),
    "rename": lambda p: os.rename(p / "empty-file", p / "moved"),
    "symlink": lambda p: os.symlink("x", p / "new-link"),
    "link": lambda p: os.link(p / "empty-file", p / "hard"),
    "chmod": lambda p: os.chmod(p / "empty-file", 0o777),
    "chown": lambda p: os.chown(p / "empty-file", 1, 1),
    "utime": lambda p: os.utime(p / "empty-file", (1, 1)),
    "truncate": lambda p: os.truncate(p / "sizes/one-byte.bin", 0),
    "setxattr": lambda p: os.setxattr(p / "empty-file", "user.x", b"1"),
    "mkfifo": lambda p: os.mkfifo(p / "fifo"),
}


@pytest.mark.parametrize("op", sorted(WRITES))
def test_writes_get_erofs(awkward_mount: Mount, op: str) -> None:
    with pytest.raises(OSError) as err:
        WRITES[op](awkward_mount.mountpoint)
    assert err.value.errno == errno.EROFS


def test_status_is_hidden_from_listings(awkward_mount: Mount) -> None:
    mnt = awkward_mount.mountpoint
    names = set(os.listdir(mnt))
    assert not any("fanfs" in n for n in names)
    assert os.listxattr(mnt) == []
    status = json.loads(os.getxattr(mnt, "user.fanfs.status"))
    assert status["serving"] and status["pid"] == awkward_mount.proc.pid
    human = fanfs("status", mnt)
    assert human.returncode == 0 and "serving" in human.stdout
