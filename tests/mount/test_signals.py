"""Mount tier: stop signals at every moment of a daemon's life: a defined exit code, and nothing
left.

SIGTERM, SIGINT and SIGHUP mean "stop" whenever they come (fanfs/node/daemon.py): during start-up
the daemon fails with exit 130 after cleaning up; while serving it unmounts and exits 0; after
its FUSE session has ended (an external unmount) it finishes cleaning up and exits 0. Never a
segfault (pyfuse3 frees its session in `close`; a late `terminate` used to dereference it),
never a mount or a staging directory left behind, also for a daemon whose parent made it ignore
SIGINT and SIGHUP (a script's `nohup cmd &`). Under MPI, a rank that lingers for its peers
stops waiting at a signal (tests/mpi/test_mpi.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import FANFS, Mount, prepare, teardown, wait_until

from fanfs import mounts
from fanfs.bench import datagen

SEGFAULT = -signal.SIGSEGV


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("signals")
    datagen.sample(base / "src", n_files=60, classes=3, seed=4)
    return prepare(base / "src", base / "img", "--partitions", "4")


def _thread_waits(pid: int) -> str:
    """Each thread of `pid`: its name and the kernel function it waits in."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            out.append(f"{(task / 'comm').read_text().strip()}:{(task / 'wchan').read_text()}")
        except OSError:
            continue
    return ", ".join(out)


def staging_left(local: Path) -> list[str]:
    return sorted(p.name for p in local.iterdir()) if local.exists() else []


def assert_clean(mountpoint: Path, local: Path) -> None:
    assert mounts.find(mountpoint) is None
    assert staging_left(local) == []


@pytest.mark.parametrize(
    ("sig", "delays"),
    [
        (signal.SIGTERM, (0.05, 0.3, 0.6, 0.9, 1.3, 2.0)),
        (signal.SIGINT, (0.4, 1.0)),
        (signal.SIGHUP, (0.4, 1.0)),
    ],
)
def test_a_stop_signal_at_any_moment_of_start_up(
    image: Path, tmp_path: Path, sig: signal.Signals, delays: tuple[float, ...]
) -> None:
    """Sent at several moments from the process's start to serving: before fanfs handles
    signals the process just ends (nothing exists yet); during start-up it cleans up and
    exits 130; once serving it unmounts and exits 0. Nothing is ever left."""
    for i, delay in enumerate(delays):
        mnt, local = tmp_path / f"mnt{i}", tmp_path / f"local{i}"
        mnt.mkdir()
        # PYTHONFAULTHANDLER: a daemon that does not stop is made to say where each of its
        # threads waits (SIGABRT), seen twice in fresh-clone CI runs and never reproduced alone.
        proc = subprocess.Popen([*FANFS, "mount", str(image), str(mnt), "--local", str(local)],
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # fmt: skip
        try:
            time.sleep(delay)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            waits = _thread_waits(proc.pid)
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit 30 s after {sig.name} at {delay} s; threads: {waits}\n{err}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()  # (its pipe closed here, not by a later test's collector)
        assert proc.returncode in (0, 130, -sig), (delay, proc.returncode, err)
        assert "Traceback" not in err and "Segmentation" not in err, err
        if proc.returncode == 130:  # handled by the daemon; or, SIGINT before it handles
            # signals (a slow start-up), Python's KeyboardInterrupt, reported by the CLI
            assert "fanfs: error: stopped by" in err or err == "fanfs: interrupted\n", err
        assert_clean(mnt, local)


def _ignoring(*sigs: signal.Signals) -> list[str]:
    """A prefix that runs a command ignoring `sigs`, as its parent made it: a script's `cmd &`
    starts cmd ignoring SIGINT, nohup ignores SIGHUP (and exec keeps both)."""
    names = " ".join(s.name.removeprefix("SIG") for s in sigs)
    return ["sh", "-c", f'trap "" {names}; exec "$0" "$@"']


def _mapped(pid: int, name: str) -> bool:
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("ignored", [False, True], ids=["foreground", "parent_ignores"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_while_the_daemon_loads(
    image: Path, tmp_path: Path, sig: signal.Signals, ignored: bool
) -> None:
    """Sent while the daemon loads its modules (its C extension is mapped, ~0.1 s before its
    Lifecycle takes the signals), a stop signal is noted and ends the start-up (130, nothing
    mounted), also when the parent made the daemon ignore SIGINT and SIGHUP (a script's
    `nohup fanfs mount ... &`). Both used to be lost, and the daemon mounted and served as if
    no signal had come: an ignored one was discarded by the kernel (seen as hangs of the
    start-up test above in CI runs at 0.4 s, SIGINT and SIGHUP only, never in the foreground),
    and Python's KeyboardInterrupt for SIGINT was swallowed by a bare `except:` in
    fanfs._native's Cython set-up (its collections.abc registration), about one time in three
    when sent at this moment."""
    mnt, local = tmp_path / "mnt", tmp_path / "local"
    mnt.mkdir()
    prefix = _ignoring(signal.SIGINT, signal.SIGHUP) if ignored else []
    proc = subprocess.Popen([*prefix, *FANFS, "mount", str(image), str(mnt), "--local", str(local)],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _mapped(proc.pid, "_native.") and time.monotonic() < deadline:
            time.sleep(0.001)  # (polled closely: the daemon takes its signals ~0.1 s later)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{sig.name} sent while loading was lost: the daemon did not exit")
    finally:
        teardown(proc, [mnt])  # type: ignore[arg-type]
        proc.communicate()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.endswith(f"fanfs: error: stopped by {sig.name} before serving\n"), err
    assert "Traceback" not in err, err
    assert_clean(mnt, local)


def test_a_signal_after_an_external_unmount(image: Path, tmp_path: Path) -> None:
    """The session ends (the user unmounted it), then a signal arrives while the daemon
    cleans up: it used to be a segfault about one time in five."""
    for i in range(5):
        m = Mount(image, tmp_path / f"mnt{i}", tmp_path / f"local{i}")
        try:
            subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], check=True, timeout=10)
            for _ in range(1 + i % 2):  # once, or twice in a row
                if m.proc.poll() is None:
                    m.proc.send_signal(signal.SIGTERM)
            assert m.proc.wait(30) == 0, m.log_text()
            assert "Segmentation" not in m.log_text()
            assert_clean(m.mountpoint, m.local)
        finally:
            m.stop()


def test_repeated_signals_while_serving(image: Path, tmp_path: Path) -> None:
    m = Mount(image, tmp_path / "mnt", tmp_path / "local")
    try:
        reader = subprocess.Popen(["cat", *map(str, sorted(m.mountpoint.rglob("*.bin")))],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            if m.proc.poll() is None:
                os.kill(m.proc.pid, sig)
        assert m.proc.wait(30) == 0, m.log_text()
        reader.wait(30)
        assert wait_until(lambda: mounts.find(m.mountpoint) is None)
        assert_clean(m.mountpoint, m.local)
    finally:
        m.stop()
