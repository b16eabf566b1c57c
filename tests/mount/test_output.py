"""Mount tier: `fanfs output`: a training job's writes, kept on the node and landed on DEST.

Real mounts as the unprivileged user (tests/conftest.py, `user`), a real DEST directory made
to fail with real permissions, real MPI ranks for --replicas 2. The oracle is what the test
wrote: after `fanfs umount`, DEST holds exactly the files the mount held, byte for byte."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FANFS, User, teardown, wait_until

from fanfs import mounts
from fanfs.errors import ExitCode

# The writer, run as the user: checkpoints written to a temporary name, fsynced (which returns
# once the file is at DEST: so every checkpoint lands, and is renamed and rotated at DEST, in
# every run), renamed into place, rotated (only the newest two kept), a log appended to after
# every one, a directory made and renamed, a file truncated; then what the mount holds, read
# back through it, as {path: hex digest} (only the user can enter the user's mount, not even
# root).
WRITER = r"""
import hashlib, json, os, sys
from pathlib import Path
mnt = Path(sys.argv[1]); n = int(sys.argv[2])
rng = __import__("random").Random(4)
(mnt / "ckpt").mkdir()
(mnt / "run-tmp").mkdir()
(mnt / "run-tmp" / "config.yaml").write_text("lr: 0.1\n")
os.rename(mnt / "run-tmp", mnt / "run")
for i in range(n):
    data = rng.randbytes(rng.randrange(1, 3 << 20))
    tmp = mnt / "ckpt" / f".epoch-{i}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, mnt / "ckpt" / f"epoch-{i}.pt")
    if i >= 2:
        os.unlink(mnt / "ckpt" / f"epoch-{i - 2}.pt")
    with open(mnt / "run" / "train.log", "a") as f:
        f.write(f"epoch {i} loss {1 / (i + 1):.4f}\n")
with open(mnt / "run" / "samples.bin", "wb") as f:
    f.write(b"x" * 100000)
os.truncate(mnt / "run" / "samples.bin", 1234)
def tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
print(json.dumps(tree(mnt)))
"""


def tree(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


class Output:
    """`fanfs output DEST MNT --local LOCAL EXTRA...` as the user (or `mpirun -np N` of it)."""

    def __init__(self, user: User, work: Path, *extra: str, ranks: int = 1,
                 local: Path | None = None, env: dict[str, str] | None = None):  # fmt: skip
        self.user, self.work, self.ranks = user, work, ranks
        self.dest = work / "dest"
        self.mnts = [work / (f"mnt-{r}" if ranks > 1 else "mnt") for r in range(ranks)]
        for d in (self.dest, *self.mnts):
            d.mkdir(exist_ok=d == self.dest)  # DEST may be a file system the test made
            os.chown(d, user.uid, user.gid)
        mnt = work / "mnt-{rank}" if ranks > 1 else self.mnts[0]
        local = local or (work / "local-{rank}" if ranks > 1 else work / "local")
        cmd: list[Any] = [*FANFS, "output", self.dest, mnt, "--local", local, *extra]
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "--enable-recovery", "-np", str(ranks), *cmd]
        self.log = work / "output.log"
        self.proc = user.popen(*cmd, log=self.log, **(env or {}))
        for m in self.mnts:
            done = user.run(*FANFS, "wait", m, "--timeout", "60")
            if done.returncode != 0:
                self.stop()
                pytest.fail(f"{m} did not come up: {done.stderr}\n{self.log.read_text()}")

    @property
    def mnt(self) -> Path:
        return self.mnts[0]

    def fanfs(self, *args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.user.run(*FANFS, *args, timeout=timeout)

    def status(self, rank: int = 0) -> dict[str, Any]:
        done = self.fanfs("status", self.mnts[rank], "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def stop(self) -> None:
        teardown(self.proc, self.mnts, None)


@pytest.fixture
def work(user: User, request: pytest.FixtureRequest) -> Iterator[Path]:
    work = user.home / request.node.name
    work.mkdir()
    os.chown(work, user.uid, user.gid)
    yield work
    if (work / "dest").exists():
        (work / "dest").chmod(0o755)  # a test that made it fail: removable again


class Talk:
    """A process of the user's that the test talks to, line by line; killed at the end."""

    def __init__(self, user: User, *args: Any):
        self.proc = subprocess.Popen(user.cmd(*args), env=user.env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def say(self, text: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def __enter__(self) -> Talk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.communicate()


@contextlib.contextmanager
def tmpfs(path: Path, size: str, uid: int, mode: str) -> Iterator[Path]:
    """A real, small file system at `path` (a node's disk, or DEST), the user's."""
    path.mkdir(exist_ok=True)
    options = f"size={size},uid={uid},mode={mode}"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_checkpoints_renamed_and_rotated_land_exactly(user: User, work: Path) -> None:
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", WRITER, out.mnt, "5")
        assert done.returncode == 0, done.stderr + out.log.read_text()
        written = json.loads(done.stdout)
        assert sorted(written) == ["ckpt/epoch-3.pt", "ckpt/epoch-4.pt", "run/config.yaml",
                                   "run/samples.bin", "run/train.log"]  # fmt: skip
        # Landing is asynchronous: what landed is counted after a sync, as a user would.
        assert out.fanfs("sync", out.mnt).returncode == 0
        status = out.status()
        assert status["kind"] == "output"
        # 13 snapshots: config.yaml, 5 checkpoints, 5 closes of the log, samples.bin written
        # and truncated. Each checkpoint landed before its rename (fsync), so none was dropped
        # at its rotation; the log's puts cannot merge either (each checkpoint's fsync waits
        # for the log's put before it): only samples.bin's truncate may take its write's place.
        landing = status["landing"]
        assert landing["dropped_puts"] == 0 and landing["merged_puts"] <= 1, landing
        assert landing["landed_files"] + landing["merged_puts"] == 13, landing
        done = out.fanfs("umount", out.mnt)
        assert done.returncode == 0, done.stderr
        assert out.proc.wait(30) == 0, out.log.read_text()
    finally:
        out.stop()
    assert tree(out.dest) == written  # nothing else: no partial file, no rotated checkpoint
    assert not [p for p in out.dest.rglob("*") if p.name.startswith(".")]
    assert (out.dest / "run" / "train.log").read_text().count("\n") == 5
    assert not list(work.glob("local/fanfs-stage-*")) and not mounts.find(out.mnt)
    assert not list(Path("/dev/shm").glob(f"fanfs-{user.uid}-*"))  # the front's buffers' file


POSIX = r"""
import errno, os, sys
mnt = sys.argv[1]
def fails(err, f, *a):
    try:
        f(*a)
    except OSError as e:
        assert e.errno == err, (f, e)
    else:
        raise AssertionError(f"{f.__name__}{a} did not fail")
p = os.path.join(mnt, "a")
with open(p, "wb") as f:
    f.write(b"0123456789")
    f.seek(4); f.write(b"ab")
with open(p, "r+b") as f:
    f.seek(20); f.write(b"z"); f.flush()  # a hole
    assert os.fstat(f.fileno()).st_size == 21
assert open(p, "rb").read() == b"0123ab6789" + bytes(10) + b"z"
fails(errno.EPERM, os.symlink, "a", os.path.join(mnt, "l"))
fails(errno.EPERM, os.link, p, os.path.join(mnt, "h"))
fails(errno.EEXIST, os.mkdir, mnt)
os.mkdir(os.path.join(mnt, "d"))
open(os.path.join(mnt, "d", "x"), "w").close()
fails(errno.ENOTEMPTY, os.rmdir, os.path.join(mnt, "d"))
fails(errno.EISDIR, os.rename, p, os.path.join(mnt, "d"))
fails(errno.ENOENT, open, os.path.join(mnt, "nope"), "rb")
os.chmod(p, 0o600)
assert os.stat(p).st_mode & 0o777 == 0o600
with open(p, "ab") as f:
    f.write(b"!"); f.flush()
    os.fsync(f.fileno())  # returns once it is at DEST
    dest = open(os.path.join(sys.argv[2], "a"), "rb").read()
    assert dest == b"0123ab6789" + bytes(10) + b"z!", dest
os.rename(os.path.join(mnt, "d", "x"), os.path.join(mnt, "y"))
os.rmdir(os.path.join(mnt, "d"))
print("ok")
"""


def test_an_old_kernels_init_still_gets_the_writes_front(user: User, work: Path) -> None:
    """With the INIT rewritten to RHEL 8's (FANFS_PRETEND_PROTOCOL=7.27: no max_pages, so
    WRITEs of at most 128 KiB), the front answers every WRITE in C and the file lands exact."""
    out = Output(user, work, env={"FANFS_PRETEND_PROTOCOL": "7.27"})
    data = os.urandom(3 << 20)
    src = work / "src.bin"
    src.write_bytes(data)
    try:
        dd = user.run("dd", f"if={src}", f"of={out.mnt / 'ckpt.bin'}", "bs=1M", "status=none")
        assert dd.returncode == 0, dd.stderr
        front = out.status()["front"]
        assert front.pop("kept").startswith("/dev/shm/")
        assert front == {"running": True, "protocol": "7.27", "off": "", "written": len(data)}
        assert out.fanfs("sync", out.mnt).returncode == 0
    finally:
        out.stop()
    assert (out.dest / "ckpt.bin").read_bytes() == data


def test_posix_for_one_writer_and_fsync_means_at_dest(user: User, work: Path) -> None:
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", POSIX, out.mnt, out.dest)
        assert done.stdout.strip() == "ok", done.stderr + out.log.read_text()
        assert out.fanfs("umount", out.mnt).returncode == 0
        assert out.proc.wait(30) == 0, out.log.read_text()
    finally:
        out.stop()
    assert sorted(tree(out.dest)) == ["a", "y"]
    assert (out.dest / "a").stat().st_mode & 0o777 == 0o600
    assert not (out.dest / "d").exists()


def test_a_failing_dest_loses_nothing_and_umount_names_what_is_missing(
    user: User, work: Path
) -> None:
    out = Output(user, work)
    try:
        write = "import sys; open(sys.argv[1], 'wb').write(bytes(range(256)) * 4096)"
        assert user.run(sys.executable, "-c", write, out.mnt / "before.pt").returncode == 0
        assert out.fanfs("sync", out.mnt).returncode == 0
        out.dest.chmod(0o555)  # DEST fails: the user may not write there any more
        assert user.run(sys.executable, "-c", write, out.mnt / "ckpt.pt").returncode == 0
        assert wait_until(lambda: out.status()["landing"]["failing"] is not None, 20)
        landing = out.status()["landing"]
        assert landing["backlog_files"] == 1 and landing["backlog_bytes"] == 1 << 20
        assert "Permission denied" in landing["failing"]["error"]
        done = out.fanfs("sync", out.mnt, "--timeout", "60")
        assert done.returncode == ExitCode.NOT_LANDED and "ckpt.pt" in done.stderr, done.stderr
        done = out.fanfs("umount", out.mnt)
        assert done.returncode == ExitCode.NOT_LANDED and "ckpt.pt" in done.stderr, done.stderr
        assert mounts.find(out.mnt) and out.proc.poll() is None  # still there, nothing lost
        out.dest.chmod(0o755)  # fixed: a retry completes it
        done = out.fanfs("umount", out.mnt)
        assert done.returncode == 0, done.stderr
        assert out.proc.wait(30) == 0, out.log.read_text()
    finally:
        out.stop()
    assert (out.dest / "ckpt.pt").read_bytes() == bytes(range(256)) * 4096
    assert sorted(tree(out.dest)) == ["before.pt", "ckpt.pt"]


def test_a_symlink_planted_in_dest_is_never_followed(user: User, work: Path) -> None:
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, user.uid, user.gid)
    out = Output(user, work)
    try:
        os.symlink(elsewhere, out.dest / "sub")  # someone's link, where a directory will land
        make = "import os, sys; os.mkdir(sys.argv[1]); open(sys.argv[1] + '/x', 'w').write('x')"
        assert user.run(sys.executable, "-c", make, out.mnt / "sub").returncode == 0
        done = out.fanfs("sync", out.mnt, "--timeout", "60")
        assert done.returncode == ExitCode.NOT_LANDED and "sub/x" in done.stderr, done.stderr
        assert "symlink" in out.status()["landing"]["failing"]["error"]
        assert list(elsewhere.iterdir()) == []
        (out.dest / "sub").unlink()
        assert out.fanfs("umount", out.mnt).returncode == 0
        assert out.proc.wait(30) == 0
    finally:
        out.stop()
    assert (out.dest / "sub" / "x").read_text() == "x" and list(elsewhere.iterdir()) == []


HOLD_OPEN = r"""
import sys
f = open(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "w")
f.write("still open\n")
f.flush()
print("open", flush=True)
sys.stdin.readline()
"""


def test_stop_signal_with_dest_down_keeps_the_files(user: User, work: Path) -> None:
    """DEST refuses, a file is held open by a job that ignores the signal: the daemon still
    ends within its drain time, and keeps both files, named."""
    out = Output(user, work, "--drain", "2")
    try:
        out.dest.chmod(0o555)
        write = "import sys; open(sys.argv[1], 'wb').write(b'k' * 5000)"
        assert user.run(sys.executable, "-c", write, out.mnt / "kept.pt").returncode == 0
        with Talk(user, sys.executable, "-c", HOLD_OPEN, out.mnt / "open.log") as holder:
            assert holder.line() == "open\n"
            pid = out.status()["pid"]  # (a process of its own: not timed)
            began = time.monotonic()
            os.kill(pid, signal.SIGTERM)  # Slurm's, without `fanfs umount`
            assert out.proc.wait(30) == ExitCode.NOT_LANDED
            # The drain, then the exit (unmount, kept.json, the interpreter's end: under 1 s
            # here, more on a loaded machine); a daemon that waits for the open file, or for
            # DEST's backoff (up to 30 s), takes far longer.
            assert time.monotonic() - began < 2 + 3, "not ended within its drain time"
        assert "kept.pt" in out.log.read_text()
    finally:
        out.stop()
    kept = list(work.glob("local/fanfs-stage-*/kept.json"))
    assert len(kept) == 1, list(work.rglob("*"))
    named = json.loads(kept[0].read_text())
    assert named["dest"] == str(out.dest) and sorted(named["files"]) == ["kept.pt", "open.log"]
    assert (kept[0].parent / named["files"]["kept.pt"]).read_bytes() == b"k" * 5000
    assert (kept[0].parent / named["files"]["open.log"]).read_bytes() == b"still open\n"


@pytest.mark.mpi
def test_replicas_land_a_killed_nodes_closed_file(user: User, work: Path) -> None:
    out = Output(user, work, "--replicas", "2", "--peer-timeout", "2", ranks=2)
    payload = os.urandom(3 << 20)
    src = work / "payload"
    src.write_bytes(payload)
    os.chmod(src, 0o644)
    try:
        out.dest.chmod(0o555)  # nothing lands yet: the copy is held, not done
        copy = "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])"
        assert user.run(sys.executable, "-c", copy, src, out.mnts[0] / "ckpt.pt").returncode == 0
        held = out.status(1)["replicas"]
        assert held["held_files"] == 1, held  # the close returned once rank 1 held it
        os.kill(out.status(0)["pid"], signal.SIGKILL)
        out.dest.chmod(0o755)
        done = out.fanfs("umount", out.mnts[1])
        assert done.returncode == 0, done.stderr
        assert wait_until(lambda: (out.dest / "ckpt.pt").exists(), 30), out.log.read_text()
        # The dead one's stale mount: its journal says ckpt.pt did not land; its partner landed
        # it meanwhile, which the unmount sees (the partner removed the dead one's marker):
        # landed again, exit 0, nothing left on the node.
        done = out.fanfs("umount", out.mnts[0])
        assert done.returncode == 0, done.stderr
    finally:
        out.stop()
    assert (out.dest / "ckpt.pt").read_bytes() == payload
    assert not [p for p in out.dest.iterdir() if p.name.startswith(".")]
    assert not list(work.glob("local-*/fanfs-stage-*"))


def test_a_peers_message_is_checked_as_data() -> None:
    from fanfs.output import messages as r

    good = r.encode(r.M_PUT, 7, b"ckpt/a.pt", mode=0o4755, part=1, parts=3, data=b"xyz")
    kind, seq, part, parts, mode, path, _, data = r.decode(good)
    assert (kind, seq, part, parts, mode, path, bytes(data)) == (
        r.M_PUT, 7, 1, 3, 0o755, b"ckpt/a.pt", b"xyz")  # fmt: skip
    bad = [
        b"\x01",  # shorter than a header
        r.encode(r.M_PUT, 1, b"../../etc/passwd", part=0, parts=1),
        r.encode(r.M_PUT, 1, b"a/./b", part=0, parts=1),
        r.encode(r.M_PUT, 1, b"a\0b", part=0, parts=1),
        r.encode(r.M_PUT, 1, b"", part=0, parts=1),
        r.encode(r.M_PUT, 1, b"a", part=3, parts=3),
        r.encode(r.M_PUT, 1, b"a", part=0, parts=r.PARTS_MAX + 1),
        r.encode(r.M_OPS["rename"], 1, b"a"),  # a rename with no new name
        r.encode(200, 1),
        r.HEADER.pack(r.M_PUT, 1, 0, 1, 0, 5000, 0) + b"a" * 5000,  # a path over PATH_MAX
        r.HEADER.pack(r.M_PUT, 1, 0, 1, 0, 50, 0) + b"a" * 10,  # lengths past the end
    ]
    for msg in bad:
        with pytest.raises(r.BadMessage):
            r.decode(msg)


FILL = r"""
import errno, os, sys
mnt = sys.argv[1]
with open(os.path.join(mnt, "filler.bin"), "wb") as f:
    f.write(b"f" * (6 << 20))
with open(os.path.join(mnt, "ckpt.pt"), "wb") as f:
    f.write(b"g" * 4096)  # a good checkpoint, then one that does not fit
try:
    with open(os.path.join(mnt, "ckpt.pt"), "wb") as f:
        for _ in range(64):
            f.write(b"b" * (1 << 20))
except OSError as e:
    print("big", errno.errorcode[e.errno])
else:
    print("big ok")
try:
    os.close(os.open(os.path.join(mnt, "ckpt.pt"), os.O_WRONLY | os.O_APPEND))
except OSError as e:  # a close of the failed file, without writing: the error again
    print("again", errno.errorcode[e.errno])
os.unlink(os.path.join(mnt, "filler.bin"))  # room again, once its put has landed
import time
deadline = time.monotonic() + 30
while True:
    try:
        with open(os.path.join(mnt, "small.pt"), "wb") as f:
            f.write(b"s" * 4096)
        break
    except OSError as e:  # ENOSPC until the filler's bytes are gone from the node
        assert e.errno == errno.ENOSPC and time.monotonic() < deadline, e
        time.sleep(0.05)
print("small ok")
"""


def test_a_full_local_disk_fails_writes_with_enospc_and_lands_no_torn_file(
    user: User, work: Path
) -> None:
    with tmpfs(work / "small", "16m", user.uid, "0700") as small:
        out = Output(user, work, local=small)
        try:
            done = user.run(sys.executable, "-c", FILL, out.mnt)
            lines = done.stdout.split("\n")[:3]
            assert lines == ["big ENOSPC", "again ENOSPC", "small ok"], done.stdout + done.stderr
            assert "ckpt.pt" in out.status()["failed_writes"]
            done = out.fanfs("umount", out.mnt)  # unmounts, and says what is not at DEST
            assert done.returncode == ExitCode.NOT_LANDED and "ckpt.pt" in done.stderr
            assert out.proc.wait(30) == ExitCode.NOT_LANDED, out.log.read_text()
            assert not mounts.find(out.mnt)
        finally:
            out.stop()
    # The checkpoint that failed never replaced the good one at DEST.
    assert tree(out.dest) == tree_of({"ckpt.pt": b"g" * 4096, "small.pt": b"s" * 4096})


def tree_of(files: dict[str, bytes]) -> dict[str, str]:
    import hashlib

    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


TOUCH = "import sys; open(sys.argv[1], 'w').close()"


def test_a_file_only_created_is_at_dest_after_sync(user: User, work: Path) -> None:
    out = Output(user, work)
    try:
        for i in range(20):  # its RELEASE may come after the close, and after the sync asks
            assert user.run(sys.executable, "-c", TOUCH, out.mnt / f"DONE-{i}").returncode == 0
            assert out.fanfs("sync", out.mnt).returncode == 0
            assert (out.dest / f"DONE-{i}").exists()
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()


def test_a_holder_skips_what_its_dead_owner_landed(tmp_path: Path) -> None:
    """The replay after an owner's death starts after the owner's marker at DEST: a rotation
    (unlink old, rename new to old, put new) applied twice would lose a checkpoint."""
    import types

    from fanfs.node.staging import StagingDir
    from fanfs.output import dest as lander
    from fanfs.output import messages, replicas

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "old.pt").write_bytes(b"1")  # what the owner's ops 1-3 left at DEST
    (dest / "new.pt").write_bytes(b"2")
    staging = StagingDir(tmp_path / "local")
    rep = replicas.Replicas(types.SimpleNamespace(rank=1, size=2), staging, lambda d: None,
                            str(dest), "0-abcd", 1.0)  # fmt: skip
    ops = [(1, "unlink", b"old.pt", b""), (2, "rename", b"new.pt", b"old.pt"),
           (3, "put", b"new.pt", b""), (4, "put", b"newest.pt", b"")]  # fmt: skip
    for seq, kind, path, new in ops:
        if kind == "put":
            rep.held.piece(seq, path, 0o644, 0, 1, memoryview(f"{seq}".encode()))
        else:
            rep._receive(0, (messages.M_OPS[kind], seq, 0, 0, 0, path, new, memoryview(b"")))
    lander.write_marker(lander.Dest(str(dest)), "0-abcd", 3)  # the owner landed 1-3
    rep._land_owners()
    assert rep.failed == "" and rep.holding == []
    assert tree(dest) == tree_of({"old.pt": b"1", "new.pt": b"2", "newest.pt": b"4"})
    staging.close()


# -- issue 38: checkpoints and logs that are never lost or torn -------------------------------


def test_a_rewrite_while_a_put_is_pending_lands_the_closed_version_whatever_is_open(
    user: User, work: Path
) -> None:
    """A closed 4 MiB checkpoint waits for DEST; a monitor holds it open read-only; the job
    rewrites it (`open(f, "wb")`, as torch.save does) and is still writing when DEST comes
    back: DEST gets the closed version, whole, then the new one once it is closed."""
    out = Output(user, work)
    a, b = os.urandom(4 << 20), os.urandom(3 << 20)
    (work / "a").write_bytes(a)
    (work / "b").write_bytes(b)
    for p in ("a", "b"):
        os.chmod(work / p, 0o644)
    rewrite = r"""
import os, shutil, sys
mnt, a, b = sys.argv[1:4]
shutil.copyfile(a, os.path.join(mnt, "latest.pt"))  # closed: its put waits for DEST
monitor = open(os.path.join(mnt, "latest.pt"), "rb")  # someone watching it
data = open(b, "rb").read()
f = open(os.path.join(mnt, "latest.pt"), "wb", buffering=0)
f.write(data[: 1 << 20])
print("writing", flush=True)
sys.stdin.readline()
f.write(data[1 << 20 :])
f.close()
assert monitor.read() == data  # the monitor's handle reads the file, not an old version
print("done", flush=True)
"""
    out.dest.chmod(0o555)
    try:
        with Talk(user, sys.executable, "-c", rewrite, out.mnt, work / "a", work / "b") as writer:
            assert writer.line() == "writing\n", out.log.read_text()
            out.dest.chmod(0o755)
            assert wait_until(lambda: (out.dest / "latest.pt").exists(), 30)
            assert (out.dest / "latest.pt").read_bytes() == a  # not a piece of the new version
            writer.say()
            assert writer.line() == "done\n"
            assert writer.wait() == 0
        assert out.fanfs("sync", out.mnt).returncode == 0
        assert (out.dest / "latest.pt").read_bytes() == b
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()


APPEND_LOG = r"""
import os, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
f = open(path, "a", buffering=1)  # a log, as logging.FileHandler keeps it: open, appended
i, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    f.write(f"step {i} loss {1 / (i + 1):.6f}\n")
    i += 1
    time.sleep(0.01)
print(i, flush=True)
sys.stdin.readline()  # the test sends the daemon its SIGTERM meanwhile
for j in range(i, i + 50):
    f.write(f"step {j} after the signal\n")
f.close()
print(i + 50, flush=True)
"""


def test_a_log_held_open_reaches_dest_as_it_grows_and_a_sigterm_lands_it_whole(
    user: User, work: Path
) -> None:
    out = Output(user, work, "--interval", "0.5")
    landed = out.dest / "train.log"
    seen: list[bytes] = []
    try:
        with Talk(user, sys.executable, "-c", APPEND_LOG, out.mnt / "train.log", "6") as writer:
            deadline = time.monotonic() + 6  # (about 12 intervals; a loaded machine's fewer)
            while time.monotonic() < deadline:  # the writer appends for 6 s, never closing
                data = landed.read_bytes() if landed.exists() else b""
                if data and (not seen or data != seen[-1]):
                    seen.append(data)
                time.sleep(0.1)
            assert len(seen) >= 3, f"DEST saw the open log change {len(seen)} times"
            lines = int(writer.line())
            os.kill(out.status()["pid"], signal.SIGTERM)  # Slurm's time limit; the job lives on
            time.sleep(0.3)
            writer.say()  # the job writes 50 more lines after the signal, then closes the log
            assert int(writer.line()) == lines + 50
            assert writer.wait() == 0
        assert out.proc.wait(60) == 0, out.log.read_text()
    finally:
        out.stop()
    final = (out.dest / "train.log").read_bytes()
    assert final.count(b"\n") == lines + 50 and final.endswith(b"after the signal\n")
    assert all(final.startswith(s) for s in seen)  # each landing a prefix: appended
    assert not list(work.glob("local/fanfs-stage-*"))


CHECKPOINTS = r"""
import os, sys
mnt, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    with open(os.path.join(mnt, f"epoch-{i}.pt"), "wb") as f:
        f.write(bytes([i]) * size)
        f.flush()
        os.fsync(f.fileno())  # at DEST when this returns
for i in range(n):  # every one reads back, most of them from DEST
    assert open(os.path.join(mnt, f"epoch-{i}.pt"), "rb").read() == bytes([i]) * size, i
with open(os.path.join(mnt, "epoch-0.pt"), "r+b") as f:  # written again: copied back first
    f.seek(10)
    f.write(b"again")
v = os.statvfs(mnt)
print(v.f_blocks * v.f_frsize)
"""


def test_the_node_keeps_only_what_it_needs_and_reads_the_rest_back_from_dest(
    user: User, work: Path
) -> None:
    """12 checkpoints of 3 MiB through a node with a 16 MiB disk: none fails with ENOSPC
    (landed ones leave the node), all read back exactly, `df` shows DEST."""
    with tmpfs(work / "small", "16m", user.uid, "0700") as small:
        out = Output(user, work, local=small)
        try:
            done = user.run(sys.executable, "-c", CHECKPOINTS, out.mnt, "12", str(3 << 20))
            assert done.returncode == 0, done.stderr + out.log.read_text()
            v = os.statvfs(out.dest)
            assert int(done.stdout) == v.f_blocks * v.f_frsize  # DEST's size, not the node's
            status = out.status()
            assert status["evicted_files"] >= 6 and status["read_back"] == 1, status
            assert out.fanfs("umount", out.mnt).returncode == 0
        finally:
            out.stop()
    want = {f"epoch-{i}.pt": bytes([i]) * (3 << 20) for i in range(12)}
    want["epoch-0.pt"] = bytes(10) + b"again" + bytes(3 << 20)[15:]
    assert tree(out.dest) == tree_of(want)


def test_a_file_that_cannot_land_is_superseded_or_skipped_and_the_rest_lands(
    user: User, work: Path
) -> None:
    """A put DEST cannot take (a directory of that name at DEST from an earlier run) blocks
    what follows until it is removed in the mount, rewritten, or skipped by the user."""
    out = Output(user, work)
    write = "import sys; open(sys.argv[1], 'wb').write(sys.argv[2].encode() * 1000)"
    try:
        (out.dest / "big.pt").mkdir()  # in the way
        (out.dest / "big.pt" / "x").write_text("an earlier run's")
        (out.dest / "other.pt").mkdir()
        (out.dest / "other.pt" / "x").write_text("an earlier run's")
        for name in ("big.pt", "a.pt", "other.pt", "b.pt"):
            assert user.run(sys.executable, "-c", write, out.mnt / name, name).returncode == 0
        done = out.fanfs("sync", out.mnt, "--timeout", "60")
        assert done.returncode == ExitCode.NOT_LANDED and "big.pt" in done.stderr, done.stderr
        assert "in the way" in done.stderr and not (out.dest / "a.pt").exists()
        assert user.run("rm", out.mnt / "big.pt").returncode == 0  # superseded: removed
        done = out.fanfs("sync", out.mnt, "--timeout", "60")
        assert done.returncode == ExitCode.NOT_LANDED and "other.pt" in done.stderr, done.stderr
        assert (out.dest / "a.pt").read_bytes() == b"a.pt" * 1000
        done = out.fanfs("sync", out.mnt, "--skip")  # skipped: kept on the node
        assert done.returncode == 0 and "skipped put other.pt" in done.stdout, done.stderr
        assert (out.dest / "b.pt").read_bytes() == b"b.pt" * 1000
        assert out.status()["landing"]["skipped"] == ["other.pt"]
        done = out.fanfs("umount", out.mnt)
        assert done.returncode == 0, done.stderr
        assert out.proc.wait(30) == 0
    finally:
        out.stop()
    assert (out.dest / "big.pt" / "x").read_text() == "an earlier run's"  # never touched
    (kept,) = work.glob("local/fanfs-stage-*/kept.json")
    named = json.loads(kept.read_text())
    assert named["files"] == {} and list(named["skipped"]) == ["other.pt"]
    assert (kept.parent / named["skipped"]["other.pt"]).read_bytes() == b"other.pt" * 1000


def test_a_dest_too_small_for_a_file_takes_its_smaller_rewrite(user: User, work: Path) -> None:
    """DEST has 4 MiB free: a 6 MiB checkpoint fails (ENOSPC at DEST) and blocks the rest;
    rewritten smaller before it could land, the new version lands in its place."""
    with tmpfs(work / "dest", "4m", user.uid, "0755") as dest:
        out = Output(user, work)
        write = "import sys; open(sys.argv[1], 'wb').write(b'c' * int(sys.argv[2]))"
        try:
            assert user.run(sys.executable, "-c", write, out.mnt / "ckpt.pt",
                            str(6 << 20)).returncode == 0  # fmt: skip
            assert user.run(sys.executable, "-c", write, out.mnt / "after.txt", "5").returncode == 0
            done = out.fanfs("sync", out.mnt, "--timeout", "60")
            assert done.returncode == ExitCode.NOT_LANDED and "No space" in done.stderr
            assert user.run(sys.executable, "-c", write, out.mnt / "ckpt.pt",
                            str(1 << 20)).returncode == 0  # fmt: skip
            done = out.fanfs("sync", out.mnt, "--timeout", "60")
            assert done.returncode == 0, done.stderr
            assert out.fanfs("umount", out.mnt).returncode == 0
            assert (dest / "ckpt.pt").read_bytes() == b"c" * (1 << 20)
            assert (dest / "after.txt").read_bytes() == b"c" * 5
            assert not [p for p in dest.iterdir() if p.name.startswith(".")]
        finally:
            out.stop()


def test_a_dest_moved_or_recreated_gets_nothing_and_force_keeps_it_for_recover(
    user: User, work: Path
) -> None:
    write = "import sys; open(sys.argv[1], 'wb').write(sys.argv[2].encode())"
    out = Output(user, work)
    try:
        assert user.run(sys.executable, "-c", write, out.mnt / "a.pt", "a").returncode == 0
        assert out.fanfs("sync", out.mnt).returncode == 0
        moved = work / "dest.old"
        out.dest.rename(moved)  # moved while mounted
        assert user.run(sys.executable, "-c", write, out.mnt / "b.pt", "b").returncode == 0
        done = out.fanfs("sync", out.mnt, "--timeout", "30")
        assert done.returncode == ExitCode.NOT_LANDED and "moved or removed" in done.stderr
        assert sorted(p.name for p in moved.iterdir()) == ["a.pt"]  # nothing in the old place
        out.dest.mkdir()  # re-created
        os.chown(out.dest, user.uid, user.gid)
        done = out.fanfs("sync", out.mnt, "--timeout", "30")
        assert done.returncode == ExitCode.NOT_LANDED and "re-created" in done.stderr
        done = out.fanfs("umount", out.mnt)
        assert done.returncode == ExitCode.NOT_LANDED and mounts.find(out.mnt)
        done = out.fanfs("umount", out.mnt, "--force")
        assert done.returncode == ExitCode.NOT_LANDED and "--recover" in done.stderr, done.stderr
        assert out.proc.wait(30) == ExitCode.NOT_LANDED and not mounts.find(out.mnt)
    finally:
        out.stop()
    assert list(out.dest.iterdir()) == []
    done = user.run(*FANFS, "output", "--recover", out.dest, "--local", work / "local")
    assert done.returncode == 0, done.stderr
    assert tree(out.dest) == tree_of({"b.pt": b"b"})
    assert not list(work.glob("local/fanfs-stage-*"))


def test_mountpoint_or_local_inside_dest_is_refused(user: User, work: Path) -> None:
    (work / "dest" / "mnt").mkdir(parents=True)
    (work / "mnt").mkdir()
    for d in (work / "dest", work / "dest" / "mnt", work / "mnt"):
        os.chown(d, user.uid, user.gid)
    for args in (["dest", "dest/mnt"], ["dest", "mnt", "--local", "dest"],
                 ["dest", "mnt", "--local", "dest/deeper"], ["dest/mnt", "dest"]):  # fmt: skip
        done = user.run(*FANFS, "output", *[work / a if not a.startswith("-") else a
                                            for a in args])  # fmt: skip
        assert done.returncode == ExitCode.MOUNTPOINT and "inside" in done.stderr, (args, done)
        assert len(done.stderr.strip().splitlines()) == 1
    assert not mounts.find(work / "mnt") and not mounts.find(work / "dest" / "mnt")


LOG_AND_ROTATE = r"""
import os, sys
mnt = sys.argv[1]
for i in range(1500):  # a log opened, appended, closed per step
    with open(os.path.join(mnt, "train.log"), "a") as f:
        f.write(f"step {i} loss {1 / (i + 1):.6f}\n")
for i in range(5):  # a checkpoint rotated: tmp + os.replace, 2 MiB each
    with open(os.path.join(mnt, "ckpt.tmp"), "wb") as f:
        f.write(bytes([i]) * (2 << 20))
    os.replace(os.path.join(mnt, "ckpt.tmp"), os.path.join(mnt, "ckpt.pt"))
print(os.path.getsize(os.path.join(mnt, "train.log")))
"""


@pytest.mark.parametrize("dest_fs", ["disk", "tmpfs"])
def test_a_log_lands_by_appends_and_superseded_checkpoints_never_land(
    user: User, work: Path, dest_fs: str
) -> None:
    """A log appended by 1,500 opens lands as appends; a checkpoint rotated while DEST cannot
    take it never lands. On tmpfs DEST's fsync costs nothing, so the lander keeps up with the
    writer and lands every checkpoint it is given in time (a CI machine's disk did the same)."""
    with contextlib.ExitStack() as stack:
        if dest_fs == "tmpfs":
            stack.enter_context(tmpfs(work / "dest", "64m", user.uid, "755"))
        out = Output(user, work)
        try:
            done = user.run(sys.executable, "-c", LOG_AND_ROTATE, out.mnt)
            assert done.returncode == 0, done.stderr
            log_size = int(done.stdout)
            assert out.fanfs("sync", out.mnt).returncode == 0
            landing = out.status()["landing"]
            # DEST got about what was written: the log's bytes once (appends; not 1,500 logs,
            # 26 MB), and at most the five checkpoints (those rotated before their turn never
            # land: how many depends on the lander's speed against the writer's).
            assert landing["landed_bytes"] <= 2 * log_size + 5 * (2 << 20), landing
            assert landing["appended_files"] > 0, landing
            out.dest.chmod(0o555)  # DEST slow: five rotations while it cannot take one
            rotate = LOG_AND_ROTATE.replace("range(1500)", "range(0)")
            assert user.run(sys.executable, "-c", rotate, out.mnt).returncode == 0
            before = out.status()["landing"]  # (nothing can land yet)
            out.dest.chmod(0o755)
            assert out.fanfs("sync", out.mnt).returncode == 0
            after = out.status()["landing"]
            assert after["landed_bytes"] - before["landed_bytes"] == 2 << 20  # the last one
            # The second to fourth were rotated while pending (the first was being tried).
            assert after["dropped_puts"] - landing["dropped_puts"] >= 3, (landing, after)
            assert out.fanfs("umount", out.mnt).returncode == 0
        finally:
            out.stop()
        assert (out.dest / "train.log").read_text().count("\n") == 1500
        assert (out.dest / "ckpt.pt").read_bytes() == bytes([4]) * (2 << 20)
        assert not (out.dest / "ckpt.tmp").exists()


MAPS = r"""
import mmap, os, sys
import numpy as np
mnt = sys.argv[1]
a = np.arange(100000, dtype=np.float32)
np.save(os.path.join(mnt, "a.npy"), a)
m = np.load(os.path.join(mnt, "a.npy"), mmap_mode="r")  # a read-only mapping
assert float(m.sum()) == float(a.sum())
with open(os.path.join(mnt, "a.npy"), "rb") as f:
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[-4:] == a[-1:].tobytes()
w = np.memmap(os.path.join(mnt, "w.bin"), dtype=np.int64, mode="w+", shape=(4096,))
w[:] = np.arange(4096)  # a shared writable mapping
w.flush()
del w
r = np.memmap(os.path.join(mnt, "w.bin"), dtype=np.int64, mode="r+", shape=(4096,))
r[0] = -1
r.flush()
del r
print("ok")
"""


def test_mappings_read_only_and_shared_work_on_the_output_view(user: User, work: Path) -> None:
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", MAPS, out.mnt)
        assert done.stdout.strip() == "ok", done.stderr + out.log.read_text()
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()
    import numpy as np

    assert np.array_equal(np.load(out.dest / "a.npy"), np.arange(100000, dtype=np.float32))
    want = np.arange(4096, dtype=np.int64)
    want[0] = -1
    assert np.array_equal(np.fromfile(out.dest / "w.bin", dtype=np.int64), want)


KILLED = r"""
import os, sys
mnt = sys.argv[1]
with open(os.path.join(mnt, "big.pt"), "wb") as f:
    f.write(os.urandom(1 << 20) * 150)
for name in ("a.pt", "b.pt"):
    with open(os.path.join(mnt, name), "wb") as f:
        f.write(name.encode() * 1000)
os.rename(os.path.join(mnt, "b.pt"), os.path.join(mnt, "c.pt"))
log = open(os.path.join(mnt, "open.log"), "w")
print("open", flush=True)
sys.stdin.readline()
log.write("never closed\n")
log.flush()
print("ready", flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def writer_thread_stopped(pid: int) -> Iterator[int]:
    """The daemon's thread that writes answered WRITEs into their files (fanfs-write,
    csrc/writes.c), stopped with ptrace (as root; the others run on), until the daemon is
    killed: what the front answers from now on is answered and never written by it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    (tid,) = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()
              if (t / "comm").read_text().strip() == "fanfs-write"]  # fmt: skip
    for request in (0x4206, 0x4207):  # PTRACE_SEIZE, PTRACE_INTERRUPT
        assert libc.ptrace(request, tid, None, None) == 0, os.strerror(ctypes.get_errno())
    wall = 0x40000000  # __WALL: a thread, not a child
    os.waitpid(tid, wall)  # stopped
    try:
        yield tid
    finally:  # killed by now: the traced thread is its tracer's to reap
        with contextlib.suppress(ChildProcessError):
            os.waitpid(tid, wall)


def test_after_a_sigkill_umount_lands_what_was_closed_and_no_partial_stays(
    user: User, work: Path
) -> None:
    out = Output(user, work)
    try:
        status = out.status()
        pid, kept_buffers = status["pid"], Path(status["front"]["kept"])
        assert kept_buffers.match(f"/dev/shm/fanfs-{user.uid}-fanfs-stage-{pid}-*-writes")
        assert kept_buffers.stat().st_mode & 0o777 == 0o600
        with Talk(user, sys.executable, "-c", KILLED, out.mnt) as writer:
            assert writer.line() == "open\n"
            # The log's line is answered and never written by the daemon: kept all the same.
            with writer_thread_stopped(pid):
                writer.say()
                assert writer.line() == "ready\n"
                # Killed while it copies big.pt to DEST: a .partial is there (for a tenth of a
                # second where DEST's writes and fsync cost little: looked for every 5 ms).
                deadline = time.monotonic() + 30
                while not any(p.name.endswith(".partial") for p in out.dest.iterdir()):
                    assert time.monotonic() < deadline, "no .partial seen"
                    time.sleep(0.005)
                os.kill(pid, signal.SIGKILL)
            out.proc.wait(30)
        done = out.fanfs("umount", out.mnt)  # the dead mount: unmounted, what it left landed
        assert done.returncode == 0, done.stderr
    finally:
        out.stop()
    assert sorted(p.name for p in out.dest.iterdir()) == ["a.pt", "big.pt", "c.pt"]
    assert (out.dest / "c.pt").read_bytes() == b"b.pt" * 1000
    assert (out.dest / "big.pt").stat().st_size == 150 << 20
    (kept,) = work.glob("local/fanfs-stage-*/kept.json")  # the log never closed: named
    files = json.loads(kept.read_text())["files"]
    assert list(files) == ["open.log"]
    assert (kept.parent / files["open.log"]).read_text() == "never closed\n"
    assert not kept_buffers.exists() and not (kept.parent / "writes").exists()


def test_a_random_sequence_of_changes_matches_a_model_in_the_mount_and_at_dest(
    user: User, work: Path
) -> None:
    """tests/mount/output_model.py: create, write, append, truncate, rename (over existing names
    too), unlink, mkdir, rmdir, fsync, close, sync, DEST failing, SIGKILL; the mount checked
    after each step, DEST after each sync and each SIGKILL's recovery."""
    model = Path(__file__).with_name("output_model.py")
    for seed, steps in SEEDS:
        run = work / f"seed-{seed}"
        run.mkdir()
        os.chown(run, user.uid, user.gid)
        done = user.run(sys.executable, model, FANFS[0], run, str(seed), str(steps), timeout=240)
        assert done.stdout.strip() == "ok", f"seed {seed}: {done.stderr[-3000:]}"


# Seeds that found bugs, then a fresh one (180 more seeds of 400-500 steps passed when this
# was written). 3: a rename over a landed file, of a file that never landed, left the old one
# at DEST; 8: a put given up while DEST refused left its partial file there; 10: an fsync
# right after DEST came back failed on the head's last failure instead of retrying it.
SEEDS = [(3, 250), (8, 400), (10, 400), (184, 400)]


def test_directory_modes_times_sparse_files_and_small_refusals(user: User, work: Path) -> None:
    script = r"""
import os, sys
mnt = sys.argv[1]
os.mkdir(os.path.join(mnt, "d"), 0o750)
open(os.path.join(mnt, "d", "f"), "w").write("x")
open(os.path.join(mnt, "d", "sparse"), "w").close()
os.truncate(os.path.join(mnt, "d", "sparse"), 1 << 30)  # a preallocation: 1 GiB of hole
os.chmod(os.path.join(mnt, "d"), 0o710)
os.utime(os.path.join(mnt, "d"), ns=(10**18, 10**18))
print(os.stat(os.path.join(mnt, "d", "sparse")).st_blocks)
"""
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", script, out.mnt)
        assert done.returncode == 0 and int(done.stdout) < 100, done.stderr
        for cmd in (["drop", out.mnt], ["plan", out.mnt, "/dev/null"]):
            done = out.fanfs(*cmd)
            assert done.returncode == ExitCode.MOUNTPOINT and "output mount" in done.stderr
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()
    d = (out.dest / "d").stat()
    assert d.st_mode & 0o777 == 0o710 and d.st_mtime_ns == 10**18
    sparse = (out.dest / "d" / "sparse").stat()
    assert sparse.st_size == 1 << 30 and sparse.st_blocks < 100
    done = user.run(*FANFS, "output", out.dest, out.mnt, "--replicas", "2")
    assert done.returncode == ExitCode.USAGE and "MPI" in done.stderr


DCP = r"""
import sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
warnings.simplefilter("ignore")  # no process group: DCP says it saves as one
mnt = sys.argv[1]
state = {f"layer{i}": torch.full((1 << 18,), float(i)) for i in range(8)}
for step in (1, 2):
    state["step"] = torch.tensor(step)
    dcp.save(state, storage_writer=FileSystemWriter(f"{mnt}/ckpt/step-{step}", sync_files=False,
                                                    thread_count=4))
loaded = {k: torch.empty_like(v) for k, v in state.items()}
dcp.load(loaded, storage_reader=FileSystemReader(f"{mnt}/ckpt/step-2"))
assert all(torch.equal(loaded[k], state[k]) for k in state)
print("ok")
"""


def test_a_dcp_checkpoint_commits_at_dest_only_after_every_shard_it_names(
    user: User, work: Path
) -> None:
    """PyTorch DCP writes its shards, then renames `.metadata` into place: the commit. A
    watcher of DEST checks, every time it sees a `.metadata`, that each shard it names is
    there, whole. DEST is down while the job saves, so everything lands at once, after."""
    import pickle
    import threading
    import warnings

    import torch.distributed.checkpoint as dcp  # now: unpickling a .metadata imports it

    out = Output(user, work)
    seen: dict[str, int] = {}
    broken: list[str] = []
    done_watching = threading.Event()

    def check(meta: Path) -> None:
        md = pickle.loads(meta.read_bytes())
        for info in md.storage_data.values():
            shard = meta.parent / info.relative_path
            size = shard.stat().st_size if shard.exists() else -1
            if size < info.offset + info.length:
                broken.append(f"{meta} names {shard.name}: {size} bytes at DEST")
        seen[meta.parent.name] = len(md.storage_data)

    def watch() -> None:
        while not done_watching.is_set():
            try:
                for meta in out.dest.glob("ckpt/step-*/.metadata"):
                    if meta.parent.name not in seen:
                        check(meta)
            except (OSError, EOFError, pickle.UnpicklingError):
                pass  # a file landing as it was looked at: looked at again
            except Exception as e:
                broken.append(repr(e))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out.dest.chmod(0o555)
        done = user.run(sys.executable, "-c", DCP, out.mnt, timeout=120)
        assert done.stdout.strip() == "ok", done.stderr[-2000:]
        out.dest.chmod(0o755)
        assert out.fanfs("sync", out.mnt).returncode == 0
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        done_watching.set()
        watcher.join(10)
        out.stop()
    assert sorted(seen) == ["step-1", "step-2"] and not broken, broken
    import torch

    loaded = {f"layer{i}": torch.empty(1 << 18) for i in range(8)} | {"step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it loads as one
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(out.dest / "ckpt" / "step-2")))
    assert int(loaded["step"]) == 2 and float(loaded["layer7"][0]) == 7.0


CLIENTS = r"""
import os, subprocess, sys
import h5py
import numpy as np
mnt, src = sys.argv[1], sys.argv[2]
subprocess.run(["tar", "-C", src, "-cf", os.path.join(mnt, "..", "src.tar"), "."], check=True)
os.mkdir(os.path.join(mnt, "tarred"))
subprocess.run(["tar", "-C", os.path.join(mnt, "tarred"), "-xpf",
                os.path.join(mnt, "..", "src.tar")], check=True)
subprocess.run(["rsync", "-a", src + "/", os.path.join(mnt, "synced") + "/"], check=True)
with h5py.File(os.path.join(mnt, "m.h5"), "w") as f:  # HDF5 rewrites its header in place
    f.create_dataset("x", data=np.arange(1000), maxshape=(None,), chunks=(100,))
with h5py.File(os.path.join(mnt, "m.h5"), "a") as f:
    f["x"].resize((2000,))
    f["x"][1000:] = np.arange(1000, 2000)
with h5py.File(os.path.join(mnt, "m.h5"), "r") as f:
    assert np.array_equal(f["x"][:], np.arange(2000))
writers = [subprocess.Popen([sys.executable, "-c",
    "import sys\nf = open(sys.argv[1], 'a')\nfor i in range(300):\n"
    "    f.write(f'{sys.argv[2]} {i:04d}\\n'); f.flush()", os.path.join(mnt, "shared.log"), str(w)])
    for w in range(4)]
assert all(p.wait() == 0 for p in writers)
print("ok")
"""


def test_tar_rsync_h5py_and_four_appenders_land_as_written(user: User, work: Path) -> None:
    """What held before the redesign must hold: tar -x and rsync -a (modes and times of
    files and directories too), h5py creating, extending and reading a file, four processes
    appending to one log with O_APPEND."""
    src = work / "src"
    user.make_sample(src, 40, seed=5)
    (src / "exec.sh").write_text("#!/bin/sh\n")
    os.chown(src / "exec.sh", user.uid, user.gid)
    os.chmod(src / "exec.sh", 0o750)
    # Times in another second than the copy's: rsync leaves a directory's time alone when its
    # second already matches (natively too), and the directory then shows when a child came.
    for i, p in enumerate(sorted(src.rglob("*"), reverse=True)):  # children before parents
        os.utime(p, ns=(10**18 + i * 10**9 + 7, 10**18 + i * 10**9 + 7))
    os.utime(src, ns=(10**18, 10**18))
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", CLIENTS, out.mnt, src, timeout=120)
        assert done.stdout.strip() == "ok", done.stderr[-2000:] + out.log.read_text()
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()

    def shape(root: Path, ns: bool) -> dict[str, tuple[int, int]]:
        at = {p: p.stat() for p in [root, *root.rglob("*")]}
        return {str(p.relative_to(root)): (st.st_mode & 0o7777, st.st_mtime_ns if ns else
                int(st.st_mtime)) for p, st in at.items()}  # fmt: skip

    for copy, ns in (("tarred", False), ("synced", True)):  # tar keeps whole seconds
        assert tree(out.dest / copy) == tree(src), copy
        assert shape(out.dest / copy, ns) == shape(src, ns), copy
    import h5py
    import numpy as np

    with h5py.File(out.dest / "m.h5", "r") as f:
        assert np.array_equal(f["x"][:], np.arange(2000))
    lines = (out.dest / "shared.log").read_text().splitlines()
    assert sorted(lines) == sorted(f"{w} {i:04d}" for w in range(4) for i in range(300))


LATE_ENTRY = r"""
import os, sys
d, e = os.path.join(sys.argv[1], "d"), os.path.join(sys.argv[1], "e")
os.mkdir(d)
f = open(os.path.join(d, "late.bin"), "wb")  # created before the directory's time is set
os.utime(d, ns=(10**18, 10**18))
f.write(b"x" * 5000)
f.close()  # its put lands after the directory's time: a new name at DEST
os.mkdir(e)
open(os.path.join(e, "gone.bin"), "wb").close()
os.utime(e, ns=(10**18, 10**18))
os.unlink(os.path.join(e, "gone.bin"))  # the directory's time moves on, as natively
print(os.stat(d).st_mtime_ns, os.stat(e).st_mtime_ns)
"""


def test_a_directory_s_set_time_holds_at_dest_when_its_entries_land_after_it(
    user: User, work: Path
) -> None:
    """tar -x, rsync -a and cp -a set a directory's mtime last. A file in it whose put lands
    after that (written and closed later, or its close seen late) adds a name at DEST: DEST's
    directory still shows the time the mount shows, as it would natively."""
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", LATE_ENTRY, out.mnt, timeout=60)
        assert done.returncode == 0, done.stderr
        d_time, e_time = map(int, done.stdout.split())
        assert d_time == 10**18 and e_time > 10**18  # the unlink moved e's on
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()
    assert (out.dest / "d" / "late.bin").read_bytes() == b"x" * 5000
    assert os.listdir(out.dest / "e") == []
    assert ((out.dest / "d").stat().st_mtime_ns, (out.dest / "e").stat().st_mtime_ns) == (
        d_time, e_time)  # fmt: skip


def test_an_open_log_replaces_an_earlier_runs_only_at_a_sync_or_close(
    user: User, work: Path
) -> None:
    """DEST holds an earlier run's train.log: the new run's log, open for appending, does not
    replace it on the way (a conditional put, dropped), but `fanfs sync` lands it."""
    out = Output(user, work, "--interval", "0.2")
    (out.dest / "train.log").write_text("an earlier run's log\n")
    try:
        with Talk(user, sys.executable, "-c", HOLD_OPEN, out.mnt / "train.log", "a") as holder:
            assert holder.line() == "open\n"
            # Intervals pass: each conditional put finds what it must not replace.
            assert wait_until(lambda: out.status()["landing"]["dropped_puts"] >= 1, 20)
            assert (out.dest / "train.log").read_text() == "an earlier run's log\n"
            assert out.fanfs("sync", out.mnt).returncode == 0
            assert (out.dest / "train.log").read_text() == "still open\n"
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()
