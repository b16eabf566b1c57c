"""Slurm tier: deploy/slurm/fanfs-job.sbatch on a real Slurm: a 4-virtual-node cluster on this
machine.

Every job reads every file through the node's own mount and compares it with the source; after
each job nothing of fanfs is left: no mount, no daemon, no staged directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO, User, prepare

from fanfs import mounts
from fanfs.bench import datagen

CLUSTER = REPO / "tools" / "slurm_cluster.sh"
JOB = REPO / "deploy" / "slurm" / "fanfs-job.sbatch"
NODES = 4


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    # Not under pytest's private temporary directory: a job of an unprivileged user (below)
    # needs to reach the cluster's per-node directories (PMIx keeps its rendezvous there).
    base = Path(tempfile.mkdtemp(prefix="fanfs-slurm-"))
    base.chmod(0o755)
    env = {
        **os.environ,
        "SLURM_CONF": str(base / "cluster" / "slurm.conf"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Virtual nodes share one machine but Open MPI believes they are separate hosts:
        # its shared-memory transport can crash then (docs/environment.md), TCP on loopback works.
        "OMPI_MCA_btl": "self,tcp",
    }
    try:
        up = subprocess.run([str(CLUSTER), "up", str(base / "cluster"), str(NODES)], env=env,
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
    finally:
        subprocess.run([str(CLUSTER), "down", str(base / "cluster")], env=env, timeout=120,
                       check=False)  # fmt: skip
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("slurm-data")
    datagen.sample(base / "src", n_files=160, classes=5, seed=11)
    return base / "src", prepare(base / "src", base / "img", "--compress", "zstd")


def staging_dirs() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("fanfs-stage-*")}


class Job:
    """One sbatch job of the template, and what it may leave: only its own mounts, mount
    directories, daemons and the staging directories that appeared while it ran count (other
    users' fanfs on this machine are none of the test's business, and are never touched)."""

    def __init__(self, env: dict[str, str], image: Path, out: Path, *command: str,
                 wait: bool = True, **extra: str):  # fmt: skip
        args = ["sbatch", "--parsable", "-N", str(NODES), "-o", str(out)]
        args += ["--wait"] if wait else []
        self.watch(out, lambda: subprocess.run([*args, str(JOB), *command],
                                               env={**env, "FANFS_IMAGE": str(image), **extra},
                                               capture_output=True, text=True, timeout=300,
                                               check=False))  # fmt: skip

    def watch(self, out: Path, submit: Callable[[], subprocess.CompletedProcess[str]]) -> None:
        self.before = staging_dirs()
        self.done = submit()
        self.id = self.done.stdout.strip().split(";")[0]
        self.out = out

    @classmethod
    def of(cls, out: Path, submit: Callable[[], subprocess.CompletedProcess[str]]) -> Job:
        """A job submitted some other way (as another user)."""
        job = cls.__new__(cls)
        job.watch(out, submit)
        return job

    @property
    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else self.done.stderr

    def leftovers(self) -> list[str]:
        prefixes = (f"/tmp/fanfs-mnt-{self.id}-", f"/tmp/fanfs-out-{self.id}-")
        left = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                if line.split()[2] in ("fuse.fanfs", "fuse.fanfs-output")
                and line.split()[1].startswith(prefixes)]  # fmt: skip
        left += [str(p) for p in Path("/tmp").glob(f"fanfs-*-{self.id}-*")]
        left += sorted(staging_dirs() - self.before)
        for what, prefix in zip(("mount", "output"), prefixes, strict=True):
            daemons = subprocess.run(["pgrep", "-f", f"fanfs {what} .*{prefix}"],
                                     capture_output=True, text=True, check=False)  # fmt: skip
            left += [f"pid {pid}" for pid in daemons.stdout.split()]
        return left

    def nothing_left(self, timeout: float = 60) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


def test_job_reads_every_file_on_every_node_and_the_next_job_adopts_what_it_kept(
    slurm: dict[str, str], dataset: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two jobs with FANFS_KEEP: each node reads every file; the first stages and keeps its
    share, the second adopts all of it."""
    src, image = dataset
    report = ("import json, os, sys; s = json.load(sys.stdin)['store']; "
              "print(os.environ['SLURMD_NODENAME'] + ': adopted', s['partitions_adopted'], "
              "'kept', s['partitions_kept'])")  # fmt: skip
    script = (f"{sys.executable} {REPO / 'tools' / 'read_check.py'} {src} && "
              f"{Path(sys.executable).with_name('fanfs')} status --json \"$FANFS_MOUNTPOINT\" | "
              f"{sys.executable} -c \"{report}\"")  # fmt: skip
    keep = str(tmp_path / "keep-{node}")
    counts = []
    for run in range(2):
        job = Job(slurm, image, tmp_path / f"job{run}.out", "bash", "-c", script, FANFS_KEEP=keep)
        assert job.done.returncode == 0, job.output
        assert job.nothing_left() == []
        ok = sorted(re.findall(r"^(n\d): OK (\d+) files$", job.output, re.M))
        assert ok == [(f"n{i}", "160") for i in range(1, NODES + 1)], job.output
        assert "command exited with 0" in job.output
        found = re.findall(r"^n\d: adopted (\d+) kept (\d+)$", job.output, re.M)
        counts.append([sum(int(f[i]) for f in found) for i in (0, 1)])
    n_parts = len(list(image.glob("part-*.pack")))
    assert counts == [[0, n_parts], [n_parts, 0]], counts
    assert len(list(tmp_path.glob("keep-n*/*.pack"))) == n_parts


def test_job_outputs_land_on_the_shared_destination(
    slurm: dict[str, str], dataset: tuple[Path, Path], tmp_path: Path
) -> None:
    """FANFS_OUTPUT: each node writes and renames a file under $FANFS_OUTPUT_DIR; after the
    job every one is in DEST (the template drained the outputs before it ended)."""
    _, image = dataset
    dest = tmp_path / "dest"
    dest.mkdir()
    write = ('f="$FANFS_OUTPUT_DIR/$SLURMD_NODENAME"; head -c 3000000 /dev/zero > "$f.tmp" && '
             'echo "from $SLURMD_NODENAME" >> "$f.tmp" && mv "$f.tmp" "$f.ckpt"')  # fmt: skip
    job = Job(slurm, image, tmp_path / "job.out", "bash", "-c", write, FANFS_OUTPUT=str(dest))
    output = job.output
    assert job.done.returncode == 0, output
    names = sorted(p.name for p in dest.iterdir())
    assert names == [f"n{i}.ckpt" for i in range(1, NODES + 1)], output
    for i in range(1, NODES + 1):
        assert (dest / f"n{i}.ckpt").read_bytes() == bytes(3000000) + f"from n{i}\n".encode()
    assert job.nothing_left() == []


def test_failing_command_leaves_nothing(slurm: dict[str, str], dataset: tuple[Path, Path],
                                        tmp_path: Path) -> None:  # fmt: skip
    _, image = dataset
    job = Job(slurm, image, tmp_path / "job.out", "bash", "-c", "ls $FANFS_MOUNTPOINT; exit 3")
    output = job.output
    assert job.done.returncode == 3, output
    assert "command exited with 3" in output
    assert output.count("train") >= NODES  # the command did see the dataset on every node
    assert job.nothing_left() == []


def test_daemon_failure_fails_fast(slurm: dict[str, str], tmp_path: Path) -> None:
    started = time.monotonic()
    job = Job(slurm, tmp_path / "no-such-image", tmp_path / "job.out", "true")
    output = job.output
    assert job.done.returncode != 0
    assert "not a fanfs image" in output
    assert "daemons exited before every mount served" in output
    assert time.monotonic() - started < 60
    assert job.nothing_left() == []


def test_scancel_mid_job_leaves_nothing(slurm: dict[str, str], dataset: tuple[Path, Path],
                                        tmp_path: Path) -> None:  # fmt: skip
    _, image = dataset
    out = tmp_path / "job.out"
    job = Job(slurm, image, out, "sleep", "600", wait=False)
    deadline = time.monotonic() + 120
    while "every node serves" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.3)
    mounted = {m for m in job.leftovers() if m.startswith("/tmp/fanfs-mnt-")
               and mounts.find(m) is not None}  # fmt: skip
    assert len(mounted) == NODES, mounted
    subprocess.run(["scancel", job.id], env=slurm, timeout=30, check=True)
    while subprocess.run(["squeue", "-h", "-j", job.id], env=slurm, capture_output=True,
                         text=True, timeout=30, check=False).stdout.strip():  # fmt: skip
        assert time.monotonic() < deadline + 120
        time.sleep(0.5)
    assert job.nothing_left() == []


def test_epilog_cleans_up_after_killed_daemons(slurm: dict[str, str], dataset: tuple[Path, Path],
                                               tmp_path: Path) -> None:  # fmt: skip
    _, image = dataset
    # Every node's task SIGKILLs its own node's daemon (and no other process on the machine):
    # the mounts go stale and the staging directories stay behind, which nothing but the
    # node epilog removes.
    kill = ('pid=$("$FANFS_BIN" status "$FANFS_MOUNTPOINT" --json | python3 -c '
            '"import json, sys; print(json.load(sys.stdin)[\'pid\'])") && '
            'echo "killing daemon $pid" && kill -9 "$pid"; sleep 2')  # fmt: skip
    job = Job(slurm, image, tmp_path / "job.out", "bash", "-c", kill)
    output = job.output
    assert job.done.returncode == 0, output
    assert len(re.findall(r"^killing daemon \d+$", output, re.M)) == NODES, output
    assert job.nothing_left() == []


def test_job_of_an_unprivileged_user(slurm: dict[str, str], user: User) -> None:
    """A cluster user (never root) submits the template: their daemons, mounts, staging and
    MPI ranks run as them, every node reads every file, and nothing is left."""
    work = user.home / "slurm-job"
    work.mkdir()
    os.chown(work, user.uid, user.gid)
    user.make_sample(work / "src", n_files=80, seed=5)
    done = user.run(Path(sys.executable).with_name("fanfs"), "prepare", work / "src", work / "img")
    assert done.returncode == 0, done.stderr
    keep = {k: slurm[k] for k in ("SLURM_CONF", "OMPI_MCA_btl")}
    check = [sys.executable, str(REPO / "tools" / "read_check.py"), str(work / "src")]
    out = work / "job.out"
    job = Job.of(out, lambda: user.run("sbatch", "--parsable", "-N", str(NODES), "-o", out,
                                       "--wait", JOB, *check, timeout=300,
                                       FANFS_IMAGE=str(work / "img"), **keep))  # fmt: skip
    output = job.output
    assert job.done.returncode == 0, output
    ok = sorted(re.findall(r"^(n\d): OK (\d+) files$", output, re.M))
    assert ok == [(f"n{i}", "80") for i in range(1, NODES + 1)], output
    assert job.nothing_left() == []
    assert list((user.home / "tmp").iterdir()) == []  # the user's default staging parent
