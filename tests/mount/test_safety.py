"""Mount tier: safe by default: nothing fanfs does can be turned by another local user, or a
mistake, into data loss or a leak. Each test is one case of docs/security.md; the attacker is
`nobody`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    FANFS,
    REPO,
    Mount,
    assert_one_line_error,
    fanfs,
    mounted,
    prepare,
    teardown,
    wait_until,
)

from fanfs import mounts
from fanfs.errors import ExitCode
from fanfs.image import catalog as cat

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
SECRET = b"SECRET-7d1f0c2b-not-for-anyone-else "


def as_nobody(*cmd: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *map(str, cmd)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def nobody_can_read(path: Path) -> bool:
    return as_nobody("head", "-c", "0", path).returncode == 0


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A scratch directory that `nobody` may enter (pytest's own are private to root)."""
    d = Path(tempfile.mkdtemp(prefix="fanfs-test-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def src(tmp: Path) -> Path:
    src = tmp / "src"
    for i in range(120):
        d = src / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_bytes(b"public line %d\n" % i * (50 + i))
    return src


@pytest.fixture
def shared(tmp: Path) -> Path:
    """A directory every user may write to, like /tmp (sticky)."""
    tmp.chmod(0o755)
    d = tmp / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


def tree_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# -- 1. staging ---------------------------------------------------------------------------


def test_planted_symlinks_redirect_no_write(src: Path, shared: Path, tmp: Path) -> None:
    victim = tmp / "victim"
    victim.write_bytes(b"root's private file\n")
    victim.chmod(0o600)
    # nobody plants symlinks to the victim under every name fanfs ever used in a shared dir.
    names = ["part-00000.pack", "part-00000.partial", "fanfs-root", "fanfs-0", "pid1"]
    for name in names:
        assert as_nobody("ln", "-s", victim, shared / name).returncode == 0
    image = prepare(src, tmp / "img", "--partitions", "4", "--compress", "none")
    with mounted(image, tmp / "mnt", shared) as m:
        assert (m.mountpoint / "c0/f0.txt").read_bytes() == (src / "c0/f0.txt").read_bytes()
        status = json.loads(os.getxattr(m.mountpoint, mounts.STATUS_XATTR))
        assert wait_until(lambda: json.loads(os.getxattr(m.mountpoint, mounts.STATUS_XATTR))
                          ["store"]["staging_done"])  # fmt: skip
        staging = Path(status["store"]["local_dir"])
        assert staging.parent == shared and stat.S_IMODE(staging.stat().st_mode) == 0o700
        assert as_nobody("ls", staging).returncode != 0  # private: not even the names
        assert list(staging.iterdir()) == []  # staged partitions have no name at all
    assert victim.read_bytes() == b"root's private file\n"
    assert sorted(p.name for p in shared.iterdir()) == sorted(names)  # ours went, theirs stay


def test_local_of_another_user_or_writable_by_all_is_refused(src: Path, tmp: Path) -> None:
    image = prepare(src, tmp / "img")
    theirs = tmp / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    (tmp / "mnt").mkdir()
    done = fanfs("mount", image, tmp / "mnt", "--local", theirs)
    assert_one_line_error(done, ExitCode.MOUNTPOINT, "belongs to uid 65534")
    open_dir = tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    done = fanfs("mount", image, tmp / "mnt", "--local", open_dir)
    assert_one_line_error(done, ExitCode.MOUNTPOINT, "not sticky")
    assert list(theirs.iterdir()) == [] and list(open_dir.iterdir()) == []


# -- 3. --local holding other files, and two daemons on one --local --------------------------


def test_local_holding_another_image_is_left_intact(src: Path, tmp: Path) -> None:
    image = prepare(src, tmp / "img", "--partitions", "4")
    other = prepare(src, tmp / "other", "--partitions", "4", "--compress", "none")
    before = tree_of(other)
    with mounted(image, tmp / "mnt", other) as m:
        for f in src.rglob("*.txt"):
            assert (m.mountpoint / f.relative_to(src)).read_bytes() == f.read_bytes()
    assert tree_of(other) == before
    assert sorted(p.name for p in other.iterdir()) == sorted(before)
    assert fanfs("verify", other).returncode == 0


def test_two_daemons_on_one_local_never_share(src: Path, tmp: Path) -> None:
    image = prepare(src, tmp / "img", "--partitions", "4")
    local = tmp / "local"
    with mounted(image, tmp / "m1", local) as first:
        with mounted(image, tmp / "m2", local) as second:
            assert len(list(local.iterdir())) == 2
            assert fanfs("umount", second.mountpoint).returncode == 0
        for f in src.rglob("*.txt"):  # the first still has all its staged data
            assert (first.mountpoint / f.relative_to(src)).read_bytes() == f.read_bytes()
        assert len(list(local.iterdir())) == 1


# -- 2. prepare --force ----------------------------------------------------------------------


def test_force_never_deletes_what_is_not_an_image(src: Path, tmp: Path) -> None:
    thesis = tmp / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("years of work")
    done = fanfs("prepare", src, thesis, "--force")
    assert_one_line_error(done, ExitCode.SOURCE, "not replacing it", "no readable catalog")
    assert (thesis / "thesis.tex").read_text() == "years of work"
    # The parent of SRC, directly and through a symlink: refused, SRC and its neighbours stay.
    (tmp / "link").symlink_to(src)
    for target in (tmp, src / "c0", tmp / "link" / "img"):
        done = fanfs("prepare", src, target, "--force")
        assert_one_line_error(done, ExitCode.SOURCE, "inside")
    assert (thesis / "thesis.tex").exists() and len(list(src.rglob("*.txt"))) == 120
    # An image with a stranger in it is not an image any more.
    image = prepare(src, tmp / "img")
    (image / "notes.txt").write_text("mine")
    done = fanfs("prepare", src, image, "--force")
    assert_one_line_error(done, ExitCode.SOURCE, "notes.txt")
    assert (image / "notes.txt").read_text() == "mine"
    (image / "notes.txt").unlink()
    assert fanfs("prepare", src, image, "--force", "--partitions", "3").returncode == 0
    assert cat.Catalog.load(image)[0].n_partitions == 3
    assert [p.name for p in tmp.iterdir() if ".old-" in p.name] == []


# -- 6. private files --------------------------------------------------------------------


def test_private_source_files_stay_private(src: Path, tmp: Path) -> None:
    tmp.chmod(0o755)
    secret = src / "c1" / "secret"
    secret.mkdir()
    for i in range(80):  # enough to train a dictionary on, if they were ever sampled
        (secret / f"s{i}.txt").write_bytes(SECRET * (20 + i))
        (secret / f"s{i}.txt").chmod(0o600)
    done = fanfs("prepare", src, tmp / "img", "--compress", "zstd")
    assert done.returncode == 0, done.stderr
    assert "80 of 200 files in the source are not readable by every user" in done.stderr
    image = tmp / "img"
    assert stat.S_IMODE(image.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in image.iterdir())
    assert not nobody_can_read(image / cat.CATALOG_NAME)
    assert not nobody_can_read(image / cat.partition_name(0))
    # Mounted by root: the staged copies are as private (and nobody cannot enter the mount).
    with mounted(image, tmp / "mnt", tmp / "local") as m:
        assert not nobody_can_read(m.mountpoint / "c1/secret/s1.txt")
    # Shared on purpose: the private files' bytes are in the partitions (warned), but no
    # dictionary in the world-readable catalog was trained on them.
    done = fanfs("prepare", src, tmp / "pub", "--compress", "zstd", "--mode", "public")
    assert done.returncode == 0, done.stderr
    assert "--mode public exposes 80 of them" in done.stderr
    c, raw = cat.Catalog.load(tmp / "pub")
    assert c.dicts and nobody_can_read(tmp / "pub" / cat.CATALOG_NAME)
    assert SECRET[:16] not in raw


# -- 7. nothing left behind ------------------------------------------------------------------


def test_killed_prepare_leftovers_are_swept(tmp: Path) -> None:
    src = tmp / "src"
    src.mkdir()
    for i in range(300):
        (src / f"{i}.bin").write_bytes(os.urandom(1 << 20))
    proc = subprocess.Popen([*FANFS, "prepare", str(src), str(tmp / "img"), "--jobs", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    partial = f".img.partial-{socket.gethostname()}-{proc.pid}"
    assert wait_until(lambda: any(tmp.glob(f"{partial}/part-*")), timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert (tmp / partial).exists()  # what a killed prepare leaves
    assert fanfs("prepare", src, tmp / "img", "--jobs", "2").returncode == 0
    assert not (tmp / partial).exists()
    assert fanfs("verify", tmp / "img").returncode == 0


@pytest.fixture
def tiny_disk(tmp: Path) -> Iterator[Path]:
    disk = tmp / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "fanfs-test", disk],
                   check=True, timeout=30)  # fmt: skip
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", disk], check=False, timeout=30)


def test_enospc_while_staging_leaves_nothing(tmp: Path, tiny_disk: Path) -> None:
    src = tmp / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.bin").write_bytes(os.urandom(50_000))
    image = prepare(src, tmp / "img", "--partitions", "2", "--compress", "none")
    with mounted(image, tmp / "mnt", tiny_disk) as m:
        assert wait_until(lambda: "staging stopped" in m.log_text(), timeout=30)
        assert "No space left" in m.log_text()
        assert os.statvfs(tiny_disk).f_bfree == os.statvfs(tiny_disk).f_blocks  # all freed
        for f in src.iterdir():
            assert (m.mountpoint / f.name).read_bytes() == f.read_bytes()


def test_killed_daemon_leaves_no_staged_data(src: Path, tmp: Path, tiny_disk: Path) -> None:
    image = prepare(src, tmp / "img", "--partitions", "4", "--compress", "none")
    m = Mount(image, tmp / "mnt", tiny_disk)
    try:
        assert wait_until(lambda: os.statvfs(tiny_disk).f_bfree < os.statvfs(tiny_disk).f_blocks)
        m.proc.kill()
        m.proc.wait(10)
        done = fanfs("umount", m.mountpoint, timeout=30)
        assert done.returncode == 0, done.stderr
        assert os.statvfs(tiny_disk).f_bfree == os.statvfs(tiny_disk).f_blocks
        (left,) = tiny_disk.iterdir()  # only the empty staging directory: the next daemon
        assert list(left.iterdir()) == []  # with this --local removes it
    finally:
        m.stop()
    with mounted(image, tmp / "mnt", tiny_disk) as again:
        assert [p for p in tiny_disk.iterdir() if p.name == left.name] == []
        assert (again.mountpoint / "c0/f0.txt").read_bytes() == (src / "c0/f0.txt").read_bytes()


# -- 8. umount and the epilog on other users' mounts -----------------------------------------


def test_umount_of_another_users_mount_is_refused_by_name(src: Path, tmp: Path) -> None:
    """Another user's mount, its daemon dead or alive: said so, and nothing is touched (it
    used to be taken for a hung daemon: "not answering", and an attempt to abort it)."""
    image = prepare(src, tmp / "img")
    tmp.chmod(0o755)
    with mounted(image, tmp / "mnt", tmp / "local") as m:
        for command in ("status", "umount"):
            done = as_nobody(*FANFS, command, m.mountpoint)
            assert_one_line_error(done, ExitCode.MOUNTPOINT, "another user's fanfs mount")
        assert m.status()["serving"]
        m.proc.kill()
        m.proc.wait(10)
        done = as_nobody(*FANFS, "umount", m.mountpoint)  # not nobody's mount to remove
        assert_one_line_error(done, ExitCode.MOUNTPOINT, "another user's fanfs mount")
        assert mounts.find(m.mountpoint) is not None


@pytest.fixture
def user_fuse() -> Iterator[None]:
    """Let unprivileged users mount, as standard distributions do (/dev/fuse 0666): this
    machine ships it 0600. Restored afterwards; the product never changes device modes."""
    before = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", before)


def test_epilog_leaves_other_users_live_mounts_alone(src: Path, tmp: Path, user_fuse: None) -> None:
    image = prepare(src, tmp / "img", "--mode", "public")
    for d in ("live", "l1"):
        (tmp / d).mkdir()
        os.chown(tmp / d, 65534, 65534)
    # nobody's live mount: root gets EACCES on it (FUSE without allow_other), not ENOTCONN.
    proc = subprocess.Popen([*NOBODY, *FANFS, "mount", str(image), str(tmp / "live"), "--local",
                             str(tmp / "l1")], stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        assert as_nobody(*FANFS, "wait", tmp / "live", "--timeout", "30").returncode == 0
        epilog = REPO / "deploy" / "slurm" / "epilog.sh"
        env = {**os.environ, "SLURM_JOB_ID": "424242", "SLURMD_NODENAME": "nX"}
        with mounted(image, tmp / "dead", tmp / "l2") as dead:
            dead.proc.kill()
            dead.proc.wait(10)
            subprocess.run(["bash", str(epilog)], env=env, check=True, timeout=60)
            assert mounts.find(dead.mountpoint) is None  # a dead daemon's: unmounted
        assert mounts.find(tmp / "live") is not None  # nobody's: still there, still serving
        assert as_nobody("cmp", tmp / "live/c0/f0.txt", src / "c0/f0.txt").returncode == 0
    finally:
        teardown(proc, [tmp / "live"], lambda: as_nobody(*FANFS, "umount", tmp / "live"))


# -- 9. smaller ones -------------------------------------------------------------------------


def test_listing_has_dots_and_status_survives_a_closed_pipe(src: Path, tmp: Path) -> None:
    image = prepare(src, tmp / "img")
    with mounted(image, tmp / "mnt", tmp / "local") as m:
        ls = subprocess.run(["ls", "-a", m.mountpoint / "c0"], capture_output=True, text=True,
                            timeout=30, check=True)  # fmt: skip
        assert ls.stdout.split()[:2] == [".", ".."]
        assert sorted(os.listdir(m.mountpoint / "c0")) == sorted(os.listdir(src / "c0"))
        done = subprocess.run(f"{FANFS[0]} status {m.mountpoint} | head -1", shell=True,
                              capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        assert "Traceback" not in done.stderr and "serving" in done.stdout


def test_nonempty_mountpoint_is_refused_unless_asked(src: Path, tmp: Path) -> None:
    image = prepare(src, tmp / "img")
    (tmp / "mnt").mkdir()
    (tmp / "mnt" / "mine.txt").write_text("hidden by a mount")
    done = fanfs("mount", image, tmp / "mnt", "--local", tmp / "l")
    assert_one_line_error(done, ExitCode.MOUNTPOINT, "not empty", "--nonempty")
    with mounted(image, tmp / "mnt", tmp / "l", "--nonempty") as m:
        assert sorted(os.listdir(m.mountpoint)) == ["c0", "c1", "c2"]
    assert (tmp / "mnt" / "mine.txt").read_text() == "hidden by a mount"


def test_info_and_mount_name_the_problem(src: Path, tmp: Path) -> None:
    image = prepare(src, tmp / "img", "--partitions", "4")
    (image / cat.partition_name(2)).unlink()
    assert_one_line_error(fanfs("info", image), ExitCode.IMAGE, "partition missing")
    (tmp / "file").write_text("x")
    assert_one_line_error(fanfs("info", tmp / "file"), ExitCode.IMAGE, "not a directory")
    started = time.monotonic()
    assert_one_line_error(fanfs("mount", tmp / "file", tmp), ExitCode.IMAGE)
    assert time.monotonic() - started < 30


def test_an_image_that_appears_meanwhile_is_replaced_only_with_force(src: Path, tmp: Path) -> None:
    """The last check happens when the new image is renamed in, not only at the start."""
    from fanfs.errors import ImageExists
    from fanfs.prepare.publish import publish

    other = prepare(src, tmp / "img", "--partitions", "2")  # appeared while we prepared
    before = tree_of(other)
    partial = tmp / ".img.partial-test"
    partial.mkdir()
    (partial / cat.CATALOG_NAME).write_bytes(b"new")
    with pytest.raises(ImageExists):
        publish(partial, other, 0, True, force=False)
    assert tree_of(other) == before and (partial / cat.CATALOG_NAME).exists()
    publish(partial, other, 0, True, force=True)
    assert (other / cat.CATALOG_NAME).read_bytes() == b"new"
    assert [p.name for p in tmp.iterdir() if ".old-" in p.name] == []
