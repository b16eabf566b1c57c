"""Unit tier: bad values that need no mount, as a new user meets them: one line `fanfs: error:
...` with the documented exit code, no traceback, nothing removed that fanfs did not make. The
switches the daemons read are checked by every command (shown with `info`), bench's outputs
and options before any work, a calibration that would divide by zero, and bench's scratch
directory. Bad values and wrong ways around a mount: tests/mount/test_usage.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error, fanfs, prepare, run_env

from fanfs.bench import datagen, launch
from fanfs.errors import ExitCode


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("usage")
    datagen.sample(base / "src", n_files=30, classes=2, seed=8)
    return prepare(base / "src", base / "img", "--partitions", "4")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("FANFS_LOG_LEVEL", "bogus"),
        ("FANFS_FRONT", "off"),
        ("FANFS_PUSH", "no"),
        ("FANFS_NATIVE_DECODE", "2"),
        ("FANFS_NATIVE_REMOTE", "yes"),
        ("FANFS_SPIN_US", "-5"),
        ("FANFS_SPIN_US", "²"),
        ("FANFS_BACKGROUND", "-1"),
        ("FANFS_BACKGROUND", "65536"),
        ("FANFS_PRETEND_PROTOCOL", "27"),
        ("FANFS_PRETEND_PROTOCOL", "7.11"),
        ("FANFS_START_TIMEOUT", "0"),
        ("FANFS_START_TIMEOUT", "1.5"),
    ],
)
def test_a_bad_switch_is_one_line_for_every_command(image: Path, var: str, value: str) -> None:
    """The variables the daemons read themselves (not an option's default) are checked by
    every command before any work: a traceback or a silent default before."""
    assert_one_line_error(run_env("info", image, **{var: value}), ExitCode.USAGE,
                          f"{var}={value!r}")  # fmt: skip


def test_outputs_are_checked_before_the_work(tmp_path: Path) -> None:
    """An unwritable --calibrate, --json or --plot: said at once, not after an hour of work."""
    started = time.monotonic()
    for args in (["bench", "--calibrate", tmp_path / "no" / "dir" / "cal.json"],
                 ["bench", "--report", tmp_path / "no" / "b.json"],
                 ["bench", "--plot", tmp_path]):  # fmt: skip
        done = fanfs(*args, "--workdir", tmp_path / "work")
        assert_one_line_error(done, ExitCode.USAGE, "cannot write" if args[1] != "--plot"
                              else "is a directory")  # fmt: skip
    assert time.monotonic() - started < 15 and not (tmp_path / "work").exists()


def test_a_calibration_that_divides_by_zero_is_refused(tmp_path: Path) -> None:
    cal = json.loads((REPO / "docs" / "calibration-vm.json").read_text())
    for key in ("disk_bytes_per_s", "stage_bytes_per_s", "local_s"):
        bad = dict(cal, **{key: 0})
        if key == "local_s":
            bad["local_s_per_byte"] = 0
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps(bad))
        done = fanfs("project", path, "--files", "1000", "--bytes", "1G", "--nodes", "1,2")
        assert_one_line_error(done, ExitCode.USAGE, key)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(cal))
    done = fanfs("project", good, "--files", "1", "--bytes", "1", "--nodes", "1,2")
    assert_one_line_error(done, ExitCode.USAGE, "2 nodes for 1 files")
    done = fanfs("project", good, "--files", "1000", "--bytes", "1M", "--nodes", "1,2", "--warm")
    assert done.returncode == 0 and "nan" not in done.stdout and " 0.000 " not in done.stdout


def test_scratch_leaves_what_was_there(tmp_path: Path) -> None:
    work = tmp_path / "work"
    for name in ("4K", "calibrate", "validate", "fanfs-bench"):
        (work / name).mkdir(parents=True)
        (work / name / "precious").write_text("mine")
    with launch.scratch(work, "fanfs-bench") as inside:
        assert inside.parent == work and inside.name.startswith("fanfs-bench-")
        (inside / "4K" / "src").mkdir(parents=True)
    assert sorted(p.name for p in work.iterdir()) == ["4K", "calibrate", "fanfs-bench",
                                                      "validate"]  # fmt: skip
    assert all((work / n / "precious").read_text() == "mine" for n in ("4K", "validate"))
    with launch.scratch(tmp_path / "new" / "parent", "x"):
        pass
    assert not (tmp_path / "new" / "parent").exists()  # made for the run, gone with it


def test_bench_rejects_bad_options(tmp_path: Path) -> None:
    done = fanfs("bench", "--sizes", "lots", "--workdir", tmp_path)
    assert done.returncode == ExitCode.USAGE
    assert "fanfs: error: bench: argument --sizes: not a size: 'lots'" in done.stderr
