"""Unit tier: the projection model (fanfs/bench/projection.py): the arithmetic, and `fanfs
project` on a saved calibration. The measured side (`fanfs bench --calibrate`, `--validate`)
is in test_bench."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import REPO, fanfs

from fanfs.bench import projection as p
from fanfs.errors import ExitCode

CAL = p.Calibration.from_json(json.loads((REPO / "docs" / "calibration-vm.json").read_text()))
IMAGENET = p.Job(files=1_281_167, bytes=140 * 10**9, readers=4)


def test_remote_share() -> None:
    job = p.Job(files=100, bytes=100)
    assert p.remote_share(job, 1) == 0
    assert p.remote_share(job, 4) == pytest.approx(0.75)
    assert p.remote_share(dataclasses.replace(job, q=0.0), 64) == 0
    assert p.remote_share(dataclasses.replace(job, q=0.1), 4) == pytest.approx(0.075)
    assert p.remote_share(dataclasses.replace(job, replicas=2), 4) == pytest.approx(0.5)
    assert p.remote_share(dataclasses.replace(job, replicas=8), 4) == 0


def test_one_reader_is_its_latency_and_more_readers_approach_the_busiest_queue() -> None:
    bounds = {"latency": 10.0, "cpu": 2.0, "daemon": 4.0, "disk": 1.0, "network": 0.0,
              "overhead": 0.0}  # fmt: skip
    assert p.epoch_seconds(bounds, 1)[0] == pytest.approx(10.0 / 1)
    times = [p.epoch_seconds(dict(bounds, latency=10.0 / r), r)[0] for r in (1, 2, 4, 8, 64)]
    assert times == sorted(times, reverse=True)  # more readers never slower
    assert times[-1] == pytest.approx(4.0, rel=0.05)  # the daemon's queue sets the pace
    assert all(t >= 4.0 - 1e-9 for t in times)
    assert p.epoch_seconds(dict(bounds, latency=10.0 / 64), 64)[1] == "daemon"
    assert p.epoch_seconds(dict(bounds, overhead=50.0), 1) == (60.0, "overhead")


def test_projection_rows() -> None:
    rows = p.project(CAL, IMAGENET)
    assert [r.nodes for r in rows] == list(p.NODES)
    assert rows[0].efficiency == pytest.approx(1.0) and rows[0].remote_share == 0
    assert all(r.epoch_s > 0 and r.bound in (*p.BOUNDS, "overhead") for r in rows)
    local = p.project(CAL, dataclasses.replace(IMAGENET, q=0.0))
    # Local shuffle never reads remotely and never does worse than global.
    assert all(r.remote_share == 0 for r in local)
    assert all(a.epoch_s <= b.epoch_s + 1e-12 for a, b in zip(local, rows, strict=True))
    # Compression halves what the disk and network carry and adds decoding.
    packed = p.epoch_bounds(CAL, dataclasses.replace(IMAGENET, ratio=2.0), 16)
    plain = p.epoch_bounds(CAL, IMAGENET, 16)
    assert packed["disk"] == pytest.approx(plain["disk"] / 2)
    assert packed["cpu"] > plain["cpu"]
    # A fixed cost per epoch ends scaling where it dominates.
    slow = p.project(CAL, dataclasses.replace(IMAGENET, q=0.0, overhead_s=30.0))
    stop, why = p.stops_scaling(slow)
    assert stop is not None and why == "overhead"


def test_compute_bound_hides_io() -> None:
    slow = dataclasses.replace(IMAGENET, compute_files_per_s=50.0)
    rows = p.project(CAL, slow, (1, 2, 64))
    assert all(r.bound == "compute" for r in rows)
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 1.0, 1.0])
    assert rows[2].epoch_s == pytest.approx(IMAGENET.files / 64 / 50.0)


def test_calibration_json_is_checked() -> None:
    assert p.Calibration.from_json(CAL.to_json()) == CAL
    broken = CAL.to_json()
    del broken["alpha_s"]
    with pytest.raises(ValueError, match="alpha_s"):
        p.Calibration.from_json(broken)
    for bad in ("x", -1.0, float("nan"), None, True):
        with pytest.raises(ValueError, match="beta_s_per_byte"):
            p.Calibration.from_json(dict(CAL.to_json(), beta_s_per_byte=bad))


def test_project_command(tmp_path: Path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL.to_json()))
    out = tmp_path / "proj.json"
    done = fanfs("project", cal, "--files", "1281167", "--bytes", "140G", "--q", "0,0.1",
                 "--link", "12G", "--net-alpha-us", "2", "--report", out, "--plot",
                 tmp_path / "p.png")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1024" in done.stdout
    assert "stops scaling at" in done.stdout or "scales to the last" in done.stdout
    got = json.loads(out.read_text())["projections"]
    assert [g["job"]["q"] for g in got] == [0.0, 0.1]
    assert all(len(g["rows"]) == len(p.NODES) for g in got)
    assert (tmp_path / "p.png").stat().st_size > 1000
    bad = tmp_path / "bad.json"
    for text in ("{}", "[1, 2]", "not json", json.dumps(dict(CAL.to_json(), cores="many"))):
        bad.write_text(text)
        done = fanfs("project", bad, "--files", "1", "--bytes", "1")
        assert done.returncode == ExitCode.USAGE and "Traceback" not in done.stderr, text
    assert fanfs("project", cal, "--files", "10").returncode == ExitCode.USAGE
    assert (
        fanfs("project", cal, "--files", "1", "--bytes", "1", "--q", "2").returncode
        == ExitCode.USAGE
    )
