"""Shared fixtures: the awkward source tree, prepared images, and real mounts that always go away.

Tiers (markers, by what a test needs; `pytest -m "not slurm"`, `-m "unit or adapter"`):
unit (pure code), adapter (handlers, reader and transports called directly under trio),
mount (real FUSE mounts), memory (a real daemon's peak memory against its budgets), mpi (real
ranks under mpirun), slurm (the local Slurm cluster), clients (real clients and the benchmark
through a mount), sanitizers (the C built with sanitizers: once, not under every Python). A test
file's tier is the folder it sits in (tests/unit/, tests/mount/, ...), and its docstring's first
words name it ("Mount tier: ..."); a test that also needs mpirun carries `@pytest.mark.mpi`
itself. The shared helpers (this file, catalogs.py, parts.py, ...) stay here, importable from
every tier's folder.

A mount is a real `fanfs mount` daemon in a subprocess. Teardown escalates: `fanfs umount`,
then SIGTERM, then SIGKILL, then a lazy unmount, so a failing test never leaves a mount behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

from fanfs import mounts
from fanfs.bench import datagen, launch

FANFS = launch.FANFS  # the installed entry point
STEP_TIMEOUT = launch.STEP_TIMEOUT  # any single fanfs command in a test: a hang fails
# The repository and this folder: helpers run as scripts (faultfs.py, tinyfs.py, ...) and the
# files tests read (docs/, tools/, deploy/) are found from here, wherever a test file sits.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# A test module may import another's helpers across tiers (test_faults.py, a mount test, takes
# test_mpi.py's mpi_mounted): every tier's folder is on the path, as the one flat folder was,
# whichever files a run collects. Test files' names stay unique across folders (pytest's
# default import mode needs that anyway).
sys.path.extend(str(d) for d in sorted(TESTS.iterdir()) if d.is_dir() and any(d.glob("test_*.py")))
# The daemons the tests start get the stop signals' default dispositions, as from a terminal,
# whatever started the run: a script's `cmd &` starts it ignoring SIGINT and nohup SIGHUP, exec
# keeps both, and a daemon signalled before it takes them (its first ~0.1 s) would then not
# stop. (tests/mount/test_signals.py makes a daemon ignore them on purpose where it means to.)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def tiers(config: pytest.Config) -> list[str]:
    """The tiers: the markers declared in pyproject.toml (plugins declare theirs beside them)
    that name a folder of tests/ (tests/unit/, tests/mount/, ...)."""
    names = [line.split(":", 1)[0].strip() for line in config.getini("markers")]
    return [name for name in names if (TESTS / name).is_dir()]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test's tier is its folder: tests/TIER/test_*.py gets the marker TIER. A test file
    anywhere else has no tier, which is a usage error (it would escape every `-m` selection)."""
    known = tiers(config)
    for item in items:
        folder = item.path.parent
        if folder.parent != TESTS or folder.name not in known:
            raise pytest.UsageError(
                f"{item.path}: a test file belongs in a tier's folder, tests/TIER/ with TIER "
                f"one of {', '.join(known)}"
            )
        item.add_marker(getattr(pytest.mark, folder.name))


fanfs = launch.run  # `fanfs ARGS...` -> CompletedProcess, never raises
teardown = launch.stop_process  # umount, SIGTERM, SIGKILL, lazy unmount: nothing is left


class Mount(launch.Daemons):
    """One real `fanfs mount` daemon in a subprocess (fanfs.bench.launch, shared with the bench
    and the demo): serving when constructed, gone after `stop` whatever state it is in."""

    def __init__(self, image: Path, mountpoint: Path, local: Path, *extra: str):
        super().__init__(image, mountpoint, local, 1, extra, wait_s=30)
        self.local = local


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


@contextlib.contextmanager
def stopping(m: S) -> Iterator[S]:
    """Yield a running mount (one daemon or many ranks); stop it however the test ends."""
    try:
        yield m
    finally:
        m.stop()


def mounted(
    image: Path, mountpoint: Path, local: Path, *extra: str
) -> contextlib.AbstractContextManager[Mount]:
    return stopping(Mount(image, mountpoint, local, *extra))


@pytest.fixture(scope="session")
def awkward_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("awkward") / "src"
    datagen.awkward(src)
    # Written back before any test reads it: ext4 allocates a file's blocks (and the 64 MiB
    # file's extent index block) at writeback, so st_blocks, which prepare records and
    # test_catalog compares with the source's, changes if writeback comes between the two.
    os.sync()
    return src


def prepare(src: Path, image: Path, *extra: str) -> Path:
    done = fanfs("prepare", src, image, *extra)
    assert done.returncode == 0, done.stderr
    return image


@pytest.fixture(scope="session", params=["none", "zstd", "auto"])
def awkward_image(
    request: pytest.FixtureRequest, awkward_src: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    image = tmp_path_factory.mktemp(f"img-{request.param}") / "awkward.fanfs"
    return prepare(awkward_src, image, "--compress", request.param, "--partitions", "7")


@pytest.fixture(scope="session")
def awkward_mount(awkward_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    base = tmp_path_factory.mktemp("mnt")
    with mounted(awkward_image, base / "mnt", base / "local") as m:
        yield m


@pytest.fixture
def small_src(tmp_path: Path) -> Path:
    """40 random files of 1 to 5 KB in 4 directories: a source for images to break."""
    src = tmp_path / "src"
    for i in range(40):
        d = src / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.bin").write_bytes(os.urandom(1000 + 97 * i))
    return src


@pytest.fixture
def small_image(small_src: Path, tmp_path: Path) -> Path:
    return prepare(small_src, tmp_path / "small.fanfs", "--partitions", "4")


def run_env(*args: str | os.PathLike[str], **env: str) -> subprocess.CompletedProcess[str]:
    """`fanfs ARGS` expected to fail at once; should it mount instead (the bug these tests look
    for), it is stopped and unmounted whatever happens."""
    proc = subprocess.Popen([*FANFS, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        out, err = "", "did not exit: a hang"
    finally:
        mountpoints = [Path(a) for a in args[2:3]] if args[:1] == ("mount",) else []
        launch.stop_process(proc, mountpoints)  # type: ignore[arg-type]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_one_line_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    """`done` failed with exit code `code` and said why in one line holding every word of
    `words`, with no traceback: what a user sees of every mistake (fanfs/errors.py)."""
    assert done.returncode == code, (done.returncode, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("fanfs: error:")]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in errors[0], errors[0]


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return True
        time.sleep(0.05)
    return False


def thread_ticks(pid: int, name: str | None = None) -> int:
    """CPU clock ticks (user and system) the threads of `pid` called `name` (None: all) have
    spent."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            if name is None or stat[stat.index("(") + 1 : stat.rindex(")")] == name:
                fields = stat[stat.rindex(")") + 2 :].split()
                total += int(fields[11]) + int(fields[12])
    return total


def quietest_ticks(threads: list[tuple[int, str | None]], seconds: float,
                   windows: int = 2) -> list[int]:  # fmt: skip
    """For each (pid, thread name or None) the fewest CPU ticks it spent in any of `windows`
    windows of `seconds`: a thread that polls spends in every window, one that sleeps may be
    kept busy in one by a loaded machine (other tests' daemons, CI's slower cores)."""
    fewest: list[int] | None = None
    for _ in range(windows):
        before = [thread_ticks(pid, name) for pid, name in threads]
        time.sleep(seconds)
        spent = [thread_ticks(p, name) - b for (p, name), b in zip(threads, before, strict=True)]
        if fewest is not None:
            spent = [min(a, b) for a, b in zip(fewest, spent, strict=True)]
        fewest = spent
    assert fewest is not None
    return fewest


# -- an unprivileged user ---------------------------------------------------------------------
# Cluster users are never root. CI runs as root, so the tests create a system user of their
# own (one per run: two suites on one machine, two developers or CI beside one, never share
# it), run fanfs as that user with setpriv, and give it what a standard distribution gives
# every user: /dev/fuse readable and writable. This machine ships it 0600, so the run's user
# gets an ACL entry of its own, removed after; the device's mode and other users' entries
# stay as they were. At the end only that user's processes are ended: this run's.

TEST_USER = f"fanfs-t{os.getpid()}"
_ACL = "system.posix_acl_access"
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permissions, id (linux/posix_acl_xattr.h, version 2)
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def _acl_entries(path: str) -> list[tuple[int, int, int]]:
    try:
        raw = os.getxattr(path, _ACL)
    except OSError:  # none yet: the mode is the whole ACL
        mode = os.stat(path).st_mode
        return [(_USER_OBJ, (mode >> 6) & 7, _NO_ID), (_GROUP_OBJ, (mode >> 3) & 7, _NO_ID),
                (_OTHER, mode & 7, _NO_ID)]  # fmt: skip
    return [_ACL_ENTRY.unpack_from(raw, 4 + i * 8) for i in range((len(raw) - 4) // 8)]


def _set_acl(path: str, entries: list[tuple[int, int, int]]) -> None:
    """Write `entries` (the mask recomputed); only the base three left: the plain mode."""
    base = [e for e in entries if e[0] in (_USER_OBJ, _GROUP_OBJ, _OTHER)]
    named = [e for e in entries if e[0] in (_USER, _GROUP)]
    if not named:
        with contextlib.suppress(OSError):
            os.removexattr(path, _ACL)
        perms = {tag: p for tag, p, _ in base}
        os.chmod(path, perms[_USER_OBJ] << 6 | perms[_GROUP_OBJ] << 3 | perms[_OTHER])
        return
    mask = 0
    for _, p, _ in named + [e for e in base if e[0] == _GROUP_OBJ]:
        mask |= p
    every = sorted(base + named + [(_MASK, mask, _NO_ID)], key=lambda e: (e[0], e[2]))
    os.setxattr(path, _ACL, struct.pack("<I", 2) + b"".join(_ACL_ENTRY.pack(*e) for e in every))


@contextlib.contextmanager
def _acl_lock() -> Iterator[None]:
    """Two runs never rewrite /dev/fuse's ACL at once."""
    with open(os.path.join(tempfile.gettempdir(), ".fanfs-tests-dev-fuse.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _drop_acl_entry(uid: int) -> None:
    with _acl_lock():
        _set_acl("/dev/fuse", [e for e in _acl_entries("/dev/fuse")
                               if not (e[0] == _USER and e[2] == uid)])  # fmt: skip


@contextlib.contextmanager
def _fuse_for(uid: int) -> Iterator[None]:
    """/dev/fuse readable and writable by `uid` while the context lasts: an ACL entry, or,
    where /dev has no ACLs (a container's tmpfs), the mode 0666 distributions ship."""
    mode = os.stat("/dev/fuse").st_mode & 0o777
    try:
        with _acl_lock():
            _set_acl("/dev/fuse", [e for e in _acl_entries("/dev/fuse") if e[2] != uid]
                     + [(_USER, 6, uid)])  # fmt: skip
    except OSError as e:
        print(f"conftest: no ACL on /dev/fuse ({e}): mode 0666 for the run", file=sys.stderr)
        os.chmod("/dev/fuse", mode | 0o666)
        try:
            yield
        finally:
            os.chmod("/dev/fuse", mode)
        return
    try:
        yield
    finally:
        _drop_acl_entry(uid)


def _forget_dead_runs_users() -> None:
    """Users of earlier runs that were killed before their clean-up (their pid is gone, or it
    is ours: a pid reused after a restart), and their entries in /dev/fuse's ACL."""
    for pw in pwd.getpwall():
        pid = pw.pw_name.removeprefix("fanfs-t")
        if not (pw.pw_name.startswith("fanfs-t") and pid.isdigit()):
            continue
        if int(pid) == os.getpid() or not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                _drop_acl_entry(pw.pw_uid)
            subprocess.run(["userdel", pw.pw_name], check=False, timeout=30, capture_output=True)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path  # a scratch directory of the user's own, also its TMPDIR

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
                "TMPDIR": str(self.home / "tmp"), "LANG": "C.UTF-8", **extra}  # fmt: skip

    def cmd(self, *args: str | os.PathLike[str]) -> list[str]:
        drop = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]
        return [*drop, *map(str, args)]

    def run(
        self, *args: str | os.PathLike[str], timeout: float = STEP_TIMEOUT, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cmd(*args), env=self.env(**env), capture_output=True,
                              text=True, timeout=timeout, check=False)  # fmt: skip

    def make_sample(self, dest: Path, n_files: int, seed: int) -> None:
        """A sample dataset (fanfs.bench.datagen) written by the user."""
        make = (
            "import sys, pathlib; from fanfs.bench import datagen; datagen.sample("
            f"pathlib.Path(sys.argv[1]), n_files={n_files}, classes=4, seed={seed})"
        )
        done = self.run(sys.executable, "-c", make, dest)
        assert done.returncode == 0, done.stderr

    def popen(
        self, *args: str | os.PathLike[str], log: Path, **env: str
    ) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen(self.cmd(*args), env=self.env(**env), stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip


@pytest.fixture(scope="session")
def user() -> Iterator[User]:
    _forget_dead_runs_users()
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", TEST_USER], check=True, timeout=30)  # fmt: skip
    pw = pwd.getpwnam(TEST_USER)
    home = Path(tempfile.mkdtemp(prefix="fanfs-user-"))
    (home / "tmp").mkdir()
    for d in (home, home / "tmp"):
        os.chown(d, pw.pw_uid, pw.pw_gid)
    home.chmod(0o755)
    u = User(TEST_USER, pw.pw_uid, pw.pw_gid, home)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_fuse_for(pw.pw_uid))
        probe = u.run(sys.executable, "-c", "import fanfs, pyfuse3")
        assert probe.returncode == 0, (
            f"{TEST_USER} cannot run this checkout's fanfs (the checkout and its .venv must be "
            f"readable by other users): {probe.stderr}"
        )
        yield u
    finally:
        stack.close()
        subprocess.run(["pkill", "-KILL", "-u", TEST_USER], check=False, timeout=30)  # ours only
        for line in Path("/proc/mounts").read_text().splitlines():
            if str(home) in line.split()[1]:
                subprocess.run(["umount", "-l", line.split()[1]], check=False, timeout=30)
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run(["userdel", TEST_USER], check=False, timeout=30)


@pytest.fixture
def fusectl() -> Iterator[None]:
    """The fuse control file system, where a connection can be aborted and its limits read
    (systemd mounts it at boot; this machine's setup script does when it is missing)."""
    # Mounted or not, the directory is empty while no FUSE connection exists: ask the table.
    with open("/proc/self/mounts") as f:
        present = any(line.split()[1:3] == [str(mounts.FUSECTL), "fusectl"] for line in f)
    mounted_here = not present
    if mounted_here:
        subprocess.run(["mount", "-t", "fusectl", "none", str(mounts.FUSECTL)], check=True,
                       timeout=30)  # fmt: skip
    try:
        yield
    finally:
        if mounted_here:
            subprocess.run(["umount", str(mounts.FUSECTL)], check=False, timeout=30)
