"""`fanfs output`: a training job's writes, kept on the node and landed on DEST.

Real mounts as the unprivileged user (tests/conftest.py, `user`), a real DEST directory made
to fail with real permissions, real MPI ranks for --replicas 2. The oracle is what the test
wrote: after `fanfs umount`, DEST holds exactly the files the mount held, byte for byte."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FANFS, User, teardown, wait_until

from fanfs import mounts
from fanfs.errors import ExitCode

# The writer, run as the user: checkpoints written to a temporary name, renamed into place,
# rotated (only the newest two kept), a log appended to after every one, a directory made and
# renamed, a file truncated; then what the mount holds, read back through it, as {path: hex
# digest} (only the user can enter the user's mount, not even root).
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
                 local: Path | None = None):  # fmt: skip
        self.user, self.work, self.ranks = user, work, ranks
        self.dest = work / "dest"
        self.mnts = [work / (f"mnt-{r}" if ranks > 1 else "mnt") for r in range(ranks)]
        for d in (self.dest, *self.mnts):
            d.mkdir()
            os.chown(d, user.uid, user.gid)
        mnt = work / "mnt-{rank}" if ranks > 1 else self.mnts[0]
        local = local or (work / "local-{rank}" if ranks > 1 else work / "local")
        cmd: list[Any] = [*FANFS, "output", self.dest, mnt, "--local", local, *extra]
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "--enable-recovery", "-np", str(ranks), *cmd]
        self.log = work / "output.log"
        self.proc = user.popen(*cmd, log=self.log)
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


def test_checkpoints_renamed_and_rotated_land_exactly(user: User, work: Path) -> None:
    out = Output(user, work)
    try:
        done = user.run(sys.executable, "-c", WRITER, out.mnt, "5")
        assert done.returncode == 0, done.stderr + out.log.read_text()
        written = json.loads(done.stdout)
        assert sorted(written) == ["ckpt/epoch-3.pt", "ckpt/epoch-4.pt", "run/config.yaml",
                                   "run/samples.bin", "run/train.log"]  # fmt: skip
        status = out.status()
        assert status["kind"] == "output" and status["landing"]["landed_files"] >= 7
        done = out.fanfs("umount", out.mnt)
        assert done.returncode == 0, done.stderr
        assert out.proc.wait(30) == 0, out.log.read_text()
    finally:
        out.stop()
    assert tree(out.dest) == written  # nothing else: no partial file, no rotated checkpoint
    assert not [p for p in out.dest.rglob("*") if p.name.startswith(".")]
    assert (out.dest / "run" / "train.log").read_text().count("\n") == 5
    assert not list(work.glob("local/fanfs-stage-*")) and not mounts.find(out.mnt)


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


def test_stop_signal_with_dest_down_keeps_the_files(user: User, work: Path) -> None:
    out = Output(user, work, "--drain", "2")
    try:
        out.dest.chmod(0o555)
        write = "import sys; open(sys.argv[1], 'wb').write(b'k' * 5000)"
        assert user.run(sys.executable, "-c", write, out.mnt / "kept.pt").returncode == 0
        os.kill(out.status()["pid"], signal.SIGTERM)  # Slurm's, without `fanfs umount` first
        assert out.proc.wait(30) == ExitCode.NOT_LANDED
        assert "kept.pt" in out.log.read_text()
    finally:
        out.stop()
    kept = list(work.glob("local/fanfs-stage-*/kept.json"))
    assert len(kept) == 1, list(work.rglob("*"))
    named = json.loads(kept[0].read_text())
    assert named["dest"] == str(out.dest) and list(named["files"]) == ["kept.pt"]
    assert (kept[0].parent / named["files"]["kept.pt"]).read_bytes() == b"k" * 5000


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
        out.fanfs("umount", out.mnts[0])  # the dead one's stale mount
    finally:
        out.stop()
    assert (out.dest / "ckpt.pt").read_bytes() == payload
    assert not [p for p in out.dest.iterdir() if p.name.startswith(".")]


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
    small = work / "small"
    small.mkdir()
    options = f"size=16m,uid={user.uid},mode=0700"  # a real, small local disk
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(small)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    try:
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
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    # The checkpoint that failed never replaced the good one at DEST.
    assert tree(out.dest) == tree_of({"ckpt.pt": b"g" * 4096, "small.pt": b"s" * 4096})


def tree_of(files: dict[str, bytes]) -> dict[str, str]:
    import hashlib

    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


REWRITE = r"""
import os, sys, time
mnt, step = sys.argv[1], sys.argv[2]
path = os.path.join(mnt, "ckpt.pt")
if step == "first":
    with open(path, "wb") as f:
        f.write(b"A" * (3 << 20))
else:  # the next checkpoint under the same name, still being written while the first lands
    f = open(path, "wb", buffering=0)
    f.write(b"B" * (1 << 20))
    print("writing", flush=True)
    sys.stdin.read()  # until the test says close
    f.write(b"B" * (2 << 20))
    f.close()
"""


def test_rewriting_a_file_whose_put_is_pending_never_lands_a_torn_copy(
    user: User, work: Path
) -> None:
    out = Output(user, work)
    try:
        out.dest.chmod(0o555)  # the first checkpoint's put waits
        assert user.run(sys.executable, "-c", REWRITE, out.mnt, "first").returncode == 0
        second = user.cmd(sys.executable, "-c", REWRITE, out.mnt, "second")
        writer = subprocess.Popen(second, env=user.env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)  # fmt: skip
        assert writer.stdout is not None and writer.stdout.readline() == b"writing\n"
        out.dest.chmod(0o755)
        assert wait_until(lambda: out.status()["landing"]["landed_files"] >= 1, 30)
        assert (out.dest / "ckpt.pt").read_bytes() == b"A" * (3 << 20)  # not the half of B
        writer.communicate(b"", timeout=60)
        assert writer.returncode == 0
        assert out.fanfs("umount", out.mnt).returncode == 0
    finally:
        out.stop()
    assert (out.dest / "ckpt.pt").read_bytes() == b"B" * (3 << 20)


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
            rep._hold_piece(seq, path, 0o644, 0, 1, memoryview(f"{seq}".encode()))
        else:
            rep._receive(0, (messages.M_OPS[kind], seq, 0, 0, 0, path, new, memoryview(b"")))
    lander.write_marker(lander.Dest(str(dest)), "0-abcd", 3)  # the owner landed 1-3
    rep._land_owners()
    assert rep.failed == "" and rep.holding == []
    assert tree(dest) == tree_of({"old.pt": b"1", "new.pt": b"2", "newest.pt": b"4"})
    staging.close()
