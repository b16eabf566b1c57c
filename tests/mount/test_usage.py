"""Mount tier: bad values and wrong ways, as a new user meets them: one line `fanfs: error: ...`
with the documented exit code, no traceback, no wait for ever, nothing removed that fanfs did
not make. Those that need no mount: tests/unit/test_cli_usage.py.

Every option takes its value through one converter (fanfs/cli/options.py), the same for the
command line and for FANFS_* variables, checked inside main's error handling: a bad variable
of `mount` breaks `mount` alone, with its name in the message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    assert_one_line_error,
    fanfs,
    mounted,
    prepare,
    run_env,
    wait_until,
)

from fanfs import mounts
from fanfs.bench import datagen, launch
from fanfs.errors import ExitCode


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("usage")
    datagen.sample(base / "src", n_files=30, classes=2, seed=8)
    return prepare(base / "src", base / "img", "--partitions", "4")


@pytest.mark.parametrize(
    ("var", "value", "command"),
    [
        ("FANFS_REPLICAS", "x", "mount"),
        ("FANFS_REPLICAS", "0", "mount"),
        ("FANFS_PEER_TIMEOUT", "nan", "mount"),
        ("FANFS_PEER_TIMEOUT", "-1", "mount"),
        ("FANFS_LINGER", "inf", "mount"),
        ("FANFS_CACHE_MB", "lots", "mount"),
        ("FANFS_PREFETCH_MB", "-5", "mount"),
        ("FANFS_COMPRESS", "gzip", "prepare"),
        ("FANFS_MODE", "everyone", "prepare"),
    ],
)
def test_a_bad_variable_is_one_line_for_its_command_only(
    image: Path, tmp_path: Path, var: str, value: str, command: str
) -> None:
    info = run_env("info", image, **{var: value})
    assert info.returncode == 0, info.stderr  # other commands do not read it
    if command == "mount":
        (tmp_path / "mnt").mkdir()
        done = run_env("mount", image, tmp_path / "mnt", **{var: value})
    else:
        done = run_env("prepare", image.parent / "src", tmp_path / "img", **{var: value})
    assert_one_line_error(done, ExitCode.USAGE, f"{var}={value!r}")
    assert mounts.find(tmp_path / "mnt") is None and not (tmp_path / "img").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["mount", "IMG", "MNT", "--peer-timeout", "-1"],
        ["mount", "IMG", "MNT", "--peer-timeout", "nan"],
        ["mount", "IMG", "MNT", "--linger", "nan"],
        ["mount", "IMG", "MNT", "--cache-mb", "0"],
        ["wait", "MNT", "--timeout", "nan"],
        ["wait", "MNT", "--timeout", "-3"],
        ["umount", "MNT", "--timeout", "-1"],
        ["plan", "MNT", "-", "--share", "-1"],
        ["info", "IMG", "--local-capacity", "big"],
        ["prepare", "IMG", "OUT", "--partitions", "0"],
        ["bench", "--sizes", "0", "--workdir", "WORK"],
        ["bench", "--readers", "2,x", "--workdir", "WORK"],
        ["bench", "--temps", "hot", "--workdir", "WORK"],
        ["bench", "--total", "nan", "--workdir", "WORK"],
        ["project", "CAL", "--files", "10", "--bytes", "1M", "--q", "2"],
        ["project", "CAL", "--files", "10", "--bytes", "1M", "--nodes", "0,2"],
        ["project", "CAL", "--files", "10", "--bytes", "1M", "--cores", "0"],
        ["project", "CAL", "--files", "10", "--bytes", "1M", "--ratio", "0.5"],
        ["project", "CAL", "--files", "10", "--bytes", "1M", "--overhead", "nan"],
        ["project", "CAL", "--validate", "--daemons", "0", "--workdir", "WORK"],
    ],
)
def test_a_bad_value_is_one_line_at_once(image: Path, tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "mnt").mkdir()
    cal = tmp_path / "cal.json"
    cal.write_text((REPO / "docs" / "calibration-vm.json").read_text())
    names = {"IMG": image, "MNT": tmp_path / "mnt", "OUT": tmp_path / "out", "CAL": cal,
             "WORK": tmp_path / "work"}  # fmt: skip
    started = time.monotonic()
    done = run_env(*[names.get(a, a) for a in args])
    assert_one_line_error(done, ExitCode.USAGE, args[0])
    assert time.monotonic() - started < 15
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
    assert mounts.find(tmp_path / "mnt") is None


# -- working directories: nothing removed that fanfs did not make -------------------------------


def test_bench_keeps_the_users_directory_of_the_same_name(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "4K").mkdir(parents=True)
    (work / "4K" / "precious").write_text("mine")
    done = fanfs("bench", "--sizes", "4K", "--total", "64K", "--min-files", "8", "--readers",
                 "1", "--temps", "warm", "--repeat", "1", "--workdir", work, "--report",
                 tmp_path / "b.json", "--plot", tmp_path / "b.png", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in work.iterdir()) == ["4K"]
    assert (work / "4K" / "precious").read_text() == "mine"


# -- mount points: symlinks, busy mounts, the image itself -----------------------------------


def test_a_mount_point_given_through_a_symlink(image: Path, tmp_path: Path) -> None:
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        link = tmp_path / "link"
        link.symlink_to(m.mountpoint)
        assert fanfs("wait", link, "--timeout", "10").returncode == 0
        assert json.loads(fanfs("status", link, "--json").stdout)["pid"] == m.proc.pid
        rel = next(p for p in m.mountpoint.rglob("*.bin")).relative_to(m.mountpoint)
        from fanfs import plan

        assert plan.publish(link, [link / rel]).planned == 1
        done = fanfs("umount", link)
        assert done.returncode == 0, done.stderr
        assert m.proc.wait(30) == 0 and mounts.find(m.mountpoint) is None


def test_umount_of_a_busy_mount_says_who_unless_forced(image: Path, tmp_path: Path) -> None:
    """A job still reads: `fanfs umount` used to return 0 and the job got ENOTCONN mid-file."""
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        reader = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]"
                                   ", 'rb'); f.read(10); time.sleep(60)",
                                   str(next(m.mountpoint.rglob("*.bin")))])  # fmt: skip
        try:
            assert wait_until(lambda: mounts.users(m.mountpoint) != [], 10)
            done = fanfs("umount", m.mountpoint)
            assert_one_line_error(done, ExitCode.MOUNTPOINT, "busy", f"pid {reader.pid}",
                                  "--force")  # fmt: skip
            assert m.status()["serving"]  # nothing was done
            done = fanfs("umount", m.mountpoint, "--force")
            assert done.returncode == 0 and f"pid {reader.pid}" in done.stderr, done.stderr
            assert m.proc.wait(30) == 0
        finally:
            reader.kill()
            reader.wait()


def test_mounting_over_the_image_is_refused(image: Path, tmp_path: Path) -> None:
    for where in (image, image.parent):
        done = fanfs("mount", image, where, "--nonempty", "--local", tmp_path / "local")
        assert_one_line_error(done, ExitCode.MOUNTPOINT, "hide the image")
    assert mounts.find(image) is None and (image / "catalog.fanfs").exists()


def test_full_local_disk_is_in_status(image: Path, tmp_path: Path) -> None:
    """Staging stops before it fills the disk, and `fanfs status` says why."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "fanfs-test", disk],
                   check=True, timeout=30)  # fmt: skip
    try:
        with mounted(image, tmp_path / "mnt", disk) as m:
            assert wait_until(lambda: m.status()["store"]["staging_stopped"], 30)
            assert "No space left" in m.status()["store"]["staging_stopped"]
            text = fanfs("status", m.mountpoint).stdout
            assert "stopped: No space left" in text and "read from the image" in text
            st = os.statvfs(disk)
            assert st.f_bavail * 20 >= st.f_blocks  # a twentieth of it left free
    finally:
        subprocess.run(["umount", "-l", disk], check=False, timeout=30)


def test_native_reads_are_counted(
    image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jobs Python hands the native pool are counted (with the front, which answers every
    READ of a staged file itself, Python hands it none: the front off here)."""
    monkeypatch.setenv("FANFS_FRONT", "0")
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        for p in sorted(m.mountpoint.rglob("*.bin")):
            p.read_bytes()
        r = m.status()["reader"]
        assert r["native_jobs"] > 0 and r["local_fetches"] >= r["native_jobs"], r


def test_root_reaches_a_users_daemon(user: object, tmp_path: Path) -> None:
    """Root gets EACCES on a user's FUSE mount like anyone else: its `status` and `umount`
    ask as the mount's owner, so a healthy user's daemon is stopped, not aborted."""
    from conftest import User

    assert isinstance(user, User)
    work = user.home / "rootcase"
    work.mkdir()
    os.chown(work, user.uid, user.gid)
    user.make_sample(work / "src", n_files=20, seed=3)
    fan = Path(sys.executable).with_name("fanfs")
    assert user.run(fan, "prepare", work / "src", work / "img").returncode == 0
    (work / "mnt").mkdir()
    os.chown(work / "mnt", user.uid, user.gid)
    daemon = user.popen(fan, "mount", work / "img", work / "mnt", log=tmp_path / "d.log")
    try:
        assert user.run(fan, "wait", work / "mnt", "--timeout", "30").returncode == 0
        status = fanfs("status", work / "mnt", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["pid"] == daemon.pid
        done = fanfs("umount", work / "mnt")
        assert done.returncode == 0, done.stderr
        assert daemon.wait(30) == 0  # it shut down itself: a SIGTERM, not an aborted connection
        assert "aborting" not in done.stderr
    finally:
        launch.stop_process(daemon, [work / "mnt"])
