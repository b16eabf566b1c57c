"""Mount tier: planned epochs on real mounts: the job's order in, files read ahead, every byte
checked.

One daemon per test (a fresh mount: nothing of it is in the page cache), files compared byte
for byte with the source. The two ways bytes read ahead reach the job: into the kernel's page
cache when the job listed the directories first (the READ never reaches the daemon), else held
in the daemon's memory until the READ takes them."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import FANFS, STEP_TIMEOUT, Mount, fanfs, mounted, prepare, wait_until

from fanfs import mounts, plan
from fanfs.errors import FanfsError
from fanfs.image import catalog as cat
from fanfs.node.partfile import open_direct
from fanfs.node.plans import MIN_WINDOW as SLACK
from fanfs.plan import PlanRefused

N_FILES = 400


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("plan") / "src"
    rng = np.random.default_rng(11)
    for i in range(N_FILES):
        path = src / f"c{i % 8}" / f"s{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(int(rng.integers(1, 40_000))))
    return src


@pytest.fixture(scope="module")
def image(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(tree, tmp_path_factory.mktemp("plan-img") / "img", "--partitions", "8")


@pytest.fixture
def mount(image: Path, tmp_path: Path) -> Iterator[Mount]:
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        yield m


def order(tree: Path, seed: int) -> list[str]:
    rels = sorted(str(p.relative_to(tree)) for p in tree.rglob("*.bin"))
    random.Random(seed).shuffle(rels)
    return rels


def plan_status(m: Mount) -> dict[str, int]:
    return m.status()["plan"]  # type: ignore[no-any-return]


def takes_direct(directory: Path) -> bool:
    """Whether the store gets O_DIRECT descriptors for files in `directory` (not on tmpfs, say):
    the store's own test, on a probe file there."""
    probe = directory / ".direct-probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        dfd = open_direct(fd)
    finally:
        os.close(fd)
        probe.unlink()
    if dfd >= 0:
        os.close(dfd)
    return dfd >= 0


def read_ahead(m: Mount, n: int) -> dict[str, int]:
    assert wait_until(lambda: plan_status(m)["prefetched"] >= n, 30), plan_status(m)
    return plan_status(m)


def test_listed_files_go_into_the_page_cache(tree: Path, mount: Mount, tmp_path: Path) -> None:
    rels = order(tree, 1)
    for d in mount.mountpoint.iterdir():  # as ImageFolder does: the kernel learns every inode
        list(os.scandir(d))
    assert wait_until(lambda: mount.status()["store"]["staging_done"], 30)
    # The staged copies' pages out of the page cache, as on a node that staged them long ago
    dropped = subprocess.run([*FANFS, "drop", str(mount.mountpoint)], capture_output=True,
                             text=True, timeout=STEP_TIMEOUT, check=False)  # fmt: skip
    assert dropped.returncode == 0, dropped.stderr
    for d in mount.mountpoint.iterdir():
        list(os.scandir(d))
    direct_before = mount.status()["native_direct_reads"]
    taken = plan.publish(mount.mountpoint, [mount.mountpoint / r for r in rels])
    assert (taken.planned, taken.missing) == (N_FILES, 0)
    s = read_ahead(mount, N_FILES)
    assert s["pushed_to_kernel"] == N_FILES and s["held_bytes"] == 0
    if mount.status()["front"]["running"]:  # staged here: read, checked, stored with no Python
        assert s["pushed_in_c"] == N_FILES
        if takes_direct(tmp_path):  # (the daemon's staging directory is in it)
            # read as READs read them: from the disk, not through a second copy in the page
            # cache that advice to the kernel would have made
            assert mount.status()["native_direct_reads"] - direct_before == N_FILES
    reads = mount.status()["reader"]["reads"]
    for r in rels:
        assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r
    assert mount.status()["reader"]["reads"] == reads  # every byte came from the page cache


def test_a_staged_file_gone_bad_is_left_to_its_read(tree: Path, image: Path,
                                                     tmp_path: Path) -> None:  # fmt: skip
    """The C's read-ahead of a planned file checks it as a READ does: a staged copy that went
    bad after staging is never stored into the page cache; the read-ahead counts it failed and
    its READ answers EIO, every other file its bytes."""
    rels = order(tree, 4)
    c, _ = cat.Catalog.load(image)
    victim = c.resolve(rels[7].encode())
    assert victim is not None
    with mounted(image, tmp_path / "mnt", tmp_path / "local", "--keep-local") as m:
        assert wait_until(lambda: m.status()["store"]["staging_done"], 30)
        staged = Path(m.status()["store"]["local_dir"]) / cat.partition_name(int(c.part[victim]))
        fd = os.open(staged, os.O_RDWR)
        try:
            at = int(c.data_off[victim]) + int(c.stored_len[victim]) // 2
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        for d in m.mountpoint.iterdir():
            list(os.scandir(d))
        plan.publish(m.mountpoint, [m.mountpoint / r for r in rels])
        assert wait_until(lambda: plan_status(m)["prefetched"] + plan_status(m)["failed"]
                          >= N_FILES, 30), plan_status(m)  # fmt: skip
        s = plan_status(m)
        assert (s["failed"], s["pushed_in_c"]) == (1, N_FILES - 1), s
        for r in rels:
            if r == rels[7]:
                with pytest.raises(OSError) as err:
                    (m.mountpoint / r).read_bytes()
                assert err.value.errno == errno.EIO
            else:
                assert (m.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r


def test_reading_at_once_while_the_daemon_reads_ahead(tree: Path, mount: Mount) -> None:
    """The job reads the moment it has published, with several threads: stores into the page
    cache meet READs of the same files (a store from the event loop's thread deadlocked)."""
    rels = order(tree, 6)
    for d in mount.mountpoint.iterdir():
        list(os.scandir(d))
    plan.publish(mount.mountpoint, rels)

    def check(part: list[str]) -> None:
        for r in part:
            assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(check, [rels[i::4] for i in range(4)], timeout=60))
    assert plan_status(mount)["prefetched"] > 0


def test_unlisted_files_wait_in_memory_and_unread_ones_are_dropped(
    tree: Path, mount: Mount
) -> None:
    rels = order(tree, 2)
    taken = plan.publish(mount.mountpoint, rels, share=3)
    assert taken.planned == N_FILES
    s = read_ahead(mount, N_FILES)
    assert s["pushed_to_kernel"] == 0 and s["held_bytes"] == sum(
        (tree / r).stat().st_size for r in rels
    )
    # The job reads 20 files, then skips to the last 100: what it went past is dropped.
    for r in rels[:20] + rels[300:]:
        assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r
    s = plan_status(mount)
    assert s["hits"] >= 120 and s["misses"] == 0, s
    skipped = sum((tree / r).stat().st_size for r in rels[20 : N_FILES - SLACK])
    assert s["dropped_unread_bytes"] == skipped, s
    # Off the plan, and the files the job skipped: still right.
    for r in rels[20:300]:
        assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r


def test_a_planned_epoch_keeps_the_front_answering(tree: Path, image: Path, tmp_path: Path) -> None:
    """With a plan, the job's LOOKUPs and READs are still answered in C (a plan once sent every
    request through Python, which made planned epochs slower than unplanned ones); only READs of
    files whose bytes the daemon holds reach it. The front tells the planner which files it
    answered: the plan follows the job to its end, and bytes read ahead for a file the front
    read itself are let go."""
    rels = order(tree, 7)
    with mounted(image, tmp_path / "mnt", tmp_path / "local", "--prefetch-mb", "1") as m:
        before = m.status()["front"]
        assert before["running"], before
        plan.publish(m.mountpoint, rels)
        read_ahead(m, 20)
        # In order (the bytes read ahead), then past what the budget let it read ahead, then
        # what was skipped.
        for r in rels[:200] + rels[300:] + rels[200:300]:
            assert (m.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r
        front = m.status()["front"]
        assert front["lookups"] - before["lookups"] >= N_FILES, front  # every open's LOOKUP
        assert front["reads"] > before["reads"], front  # files not read ahead yet: in C
        assert wait_until(lambda: plan_status(m)["position"] == N_FILES), plan_status(m)
        assert wait_until(lambda: plan_status(m)["held_bytes"] == 0), plan_status(m)
        s = plan_status(m)
        assert s["hits"] >= 20 and s["misses"] > 0, s  # held bytes by Python, the rest in C
        assert s["followed"] >= N_FILES and s["followed_lost"] == 0, s
        assert s["hits"] + s["misses"] <= N_FILES, s


def test_a_budget_bounds_how_far_ahead(tree: Path, image: Path, tmp_path: Path) -> None:
    rels = order(tree, 3)
    with mounted(image, tmp_path / "mnt", tmp_path / "local", "--prefetch-mb", "1") as m:
        plan.publish(m.mountpoint, rels)
        assert wait_until(lambda: plan_status(m)["prefetched"] > 0, 30), plan_status(m)
        time.sleep(1)  # (time to read everything, were the budget not kept)
        s = plan_status(m)
        assert 0 < s["prefetched"] < N_FILES and s["held_bytes"] <= (1 << 20) + 8 * 40_000, s
        for k, r in enumerate(rels):  # reading moves the window; progress moves it too
            assert (m.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r
            time.sleep(0.002)  # a step between samples: read-ahead keeps up (a file the reader
            if k == 100:  # reached first is not read ahead)
                plan.progress(m.mountpoint, 200)
        s = plan_status(m)
        # The window holds about 50 of these files: progress alone would move it to about
        # 100 read ahead, reads moving it too to most of the 400.
        assert s["prefetched"] > N_FILES // 3 and s["hits"] > 0, s


def test_a_new_plan_replaces_the_share_and_cli_reads_a_file(
    tree: Path, mount: Mount, tmp_path: Path
) -> None:
    rels = order(tree, 4)
    listing = tmp_path / "epoch.txt"
    listing.write_text("\n".join([*rels[:50], "no/such/file"]) + "\n")
    done = fanfs("plan", mount.mountpoint, listing)
    assert done.returncode == 0, done.stderr
    assert "planned 50 files for share 0 (1 paths name no file" in done.stdout
    piped = subprocess.run([*FANFS, "plan", str(mount.mountpoint), "-"],
                           input="\n".join(rels[50:60]), capture_output=True, text=True,
                           timeout=60, check=False)  # fmt: skip
    assert piped.returncode == 0 and "planned 10 files" in piped.stdout, piped.stderr
    s = read_ahead(mount, 10)
    assert s["shares"] == 1 and s["planned"] == 60 and s["missing"] == 1, s
    for r in rels[50:60]:
        assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r


def test_hostile_plans_get_an_error_and_harm_nothing(tree: Path, mount: Mount) -> None:
    name = mount.status()["plan_socket"]
    assert name.startswith("@fanfs-plan-")  # abstract: nothing in any directory

    def raw(message: bytes, close_write: bool = True) -> dict[str, object]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect("\0" + name[1:])
            s.sendall(message)
            if close_write:
                s.shutdown(socket.SHUT_WR)
            got: dict[str, object] = json.loads(s.makefile("rb").readline())
            return got

    assert "not a fanfs plan request" in str(raw(b"GET / HTTP/1.0\r\n\r\n")["error"])
    assert "too long" in str(raw(b"x" * 100_000)["error"])
    assert "integers" in str(raw(b"FANFS-PLAN 1 order zero 5\n")["error"])
    assert "more than this image takes" in str(raw(b"FANFS-PLAN 1 order 0 99999999\n")["error"])
    assert "ended after 2 of 5" in str(raw(b"FANFS-PLAN 1 order 0 5\na\0b\0")["error"])
    assert raw(b"FANFS-PLAN 1 at 7 100\n") == {"ok": True}  # progress for no plan: ignored
    with pytest.raises(PlanRefused, match="not under"):
        plan.publish(mount.mountpoint, ["/etc/passwd"])
    with pytest.raises(PlanRefused, match="NUL"):
        plan.publish(mount.mountpoint, ["a\0b"])
    assert plan_status(mount)["refused"] == 5
    rels = order(tree, 5)[:30]  # and the daemon still plans and serves
    assert plan.publish(mount.mountpoint, rels).planned == 30
    for r in rels:
        assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r


def test_progress_never_waits_for_the_daemon(tree: Path, mount: Mount) -> None:
    """A sampler sends progress every 64 samples: a daemon whose event loop is busy (here
    stopped) must not hold the job. The message is taken once the daemon runs again."""
    plan.publish(mount.mountpoint, order(tree, 9))
    channel = plan.Channel(mount.mountpoint)  # found while the daemon answers
    sent = threading.Thread(target=channel.progress, args=(300,), daemon=True)
    os.kill(mount.proc.pid, signal.SIGSTOP)
    try:
        sent.start()
        sent.join(5)
        assert not sent.is_alive()  # it used to wait for the daemon's answer
    finally:
        os.kill(mount.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: plan_status(mount)["position"] >= 300, 30), plan_status(mount)


def test_progress_finds_its_daemon_once(tree: Path, mount: Mount) -> None:
    """`fanfs.plan.progress`, called every 64 samples, finds the daemon once per process: it
    used to read the mount's status at each call, which a busy daemon (here stopped) answers
    late."""
    plan.publish(mount.mountpoint, order(tree, 9))
    plan.progress(mount.mountpoint, 10)  # found while the daemon answers
    sent = threading.Thread(target=plan.progress, args=(mount.mountpoint, 300), daemon=True)
    os.kill(mount.proc.pid, signal.SIGSTOP)
    try:
        sent.start()
        sent.join(5)
        assert not sent.is_alive()
    finally:
        os.kill(mount.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: plan_status(mount)["position"] >= 300, 30), plan_status(mount)


def kept_as_if_reused(old: plan.Channel, mnt: Path) -> None:
    """Keep `progress`'s way to an ended daemon under the new mount's device number at
    `mnt`, as when the kernel gives a new mount the old one's number (it reuses them)."""
    entry = mounts.find(mnt)
    assert entry is not None
    plan._channels[(old.root, entry.device)] = old


def test_progress_reaches_a_daemon_mounted_there_again(tree: Path, image: Path,
                                                        tmp_path: Path) -> None:  # fmt: skip
    """The way to the daemon `progress` keeps is found again for a new mount at the same
    place, also when the new mount has the old one's device number (the kernel reuses them):
    its daemon's socket is gone then. That case is made sure of: the old mount's way is kept
    under the new mount's number."""
    mnt = tmp_path / "mnt"
    with mounted(image, mnt, tmp_path / "local1") as first:
        plan.publish(mnt, order(tree, 3))
        plan.progress(mnt, 10)
        assert wait_until(lambda: plan_status(first)["position"] >= 10, 30)
        _, old = plan._channel(mnt)
    with mounted(image, mnt, tmp_path / "local2") as again:
        kept_as_if_reused(old, mnt)
        plan.publish(mnt, order(tree, 4))
        plan.progress(mnt, 20)
        assert wait_until(lambda: plan_status(again)["position"] >= 20, 30), plan_status(again)


# A Python script (then its arguments) run as another user: user nobody.
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
             "-c"]  # fmt: skip


def test_no_other_user_can_plan(tree: Path, mount: Mount) -> None:
    """Another user finds the socket's name (abstract names are listed in /proc/net/unix) and
    connects: the daemon checks the uid first and refuses; nothing is planned."""
    name = mount.status()["plan_socket"]
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.settimeout(30)\n"
        "s.connect(chr(0) + sys.argv[1])\n"
        "try:\n"  # the daemon may have refused and closed before we send: that is the point
        "    s.sendall(b'FANFS-PLAN 1 order 0 1' + bytes([10]) + b'c1/s0001.bin' + bytes(1))\n"
        "    s.shutdown(socket.SHUT_WR)\n"
        "except OSError:\n"
        "    pass\n"
        "print(s.makefile().readline())\n"
    )
    probe = subprocess.run([*AS_NOBODY, script, name[1:]], capture_output=True, text=True,
                           timeout=60, check=False)  # fmt: skip
    assert "may not plan" in probe.stdout, (probe.stdout, probe.stderr)
    s = plan_status(mount)
    assert s["shares"] == 0 and s["planned"] == 0 and s["refused"] == 1, s


def test_progress_finds_its_daemon_again_after_another_users_socket(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    """Another user binds the abstract name of a daemon that has ended (names are listed in
    /proc/net/unix) while a new daemon is mounted at the same place with the old device
    number: `progress` refuses that socket (its uid), and the next call finds the new
    daemon instead of refusing for good."""
    mnt = tmp_path / "mnt"
    with mounted(image, mnt, tmp_path / "local1"):
        plan.progress(mnt, 0)
        _, old = plan._channel(mnt)
    script = (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind(chr(0) + sys.argv[1])\n"
        "s.listen(64)\n"
        "print('bound', flush=True)\n"
        "time.sleep(60)\n"
    )
    squatter = subprocess.Popen([*AS_NOBODY, script, old.socket[1:]], stdout=subprocess.PIPE,
                                text=True)  # fmt: skip
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "bound\n"
        with mounted(image, mnt, tmp_path / "local2") as again:
            kept_as_if_reused(old, mnt)
            plan.publish(mnt, order(tree, 4))
            with pytest.raises(FanfsError, match="belongs to uid"):
                plan.progress(mnt, 20)
            plan.progress(mnt, 30)
            assert wait_until(lambda: plan_status(again)["position"] >= 30, 30), plan_status(again)
    finally:
        squatter.kill()
        squatter.communicate(timeout=30)


def test_other_users_connections_do_not_hold_the_owners(tree: Path, mount: Mount) -> None:
    """Another user holds 64 connections open to the socket and sends nothing: each is refused
    at once, before it takes one of the daemon's CONNECTIONS, and the owner's plan is taken
    at once. It used to wait behind them: each held a turn for 5 s (DRAIN_S) after its
    refusal, 8 at a time."""
    name = mount.status()["plan_socket"]
    script = (
        "import socket, sys, time\n"
        "held = []\n"
        "for _ in range(64):\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    s.connect(chr(0) + sys.argv[1])\n"
        "    held.append(s)\n"
        "print('holding', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([*AS_NOBODY, script, name[1:]], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        began = time.monotonic()
        taken = plan.publish(mount.mountpoint, order(tree, 5))
        assert taken.planned == N_FILES and time.monotonic() - began < 10
        assert wait_until(lambda: plan_status(mount)["refused"] == 64, 30), plan_status(mount)
    finally:
        holder.kill()
        holder.communicate(timeout=30)  # (and its pipe closed)


def _read_slowly(mount: Mount, tree: Path, rels: list[str]) -> None:
    for r in rels:
        assert (mount.mountpoint / r).read_bytes() == (tree / r).read_bytes(), r
        time.sleep(0.002)  # a training step between samples: read-ahead keeps up


def test_repeats_and_shared_padding_keep_the_plan_ahead(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    """Samplers pad a rank by repeating its first samples, and ranks of one node share that
    padding. The first READ of a repeated file used to move the position to its last
    occurrence and end read-ahead (117 misses of 134 reads). Two ranks, a small budget."""
    rels = order(tree, 7)
    a = rels[:200] + rels[:24]  # rank 0, padded with its own first samples
    b = rels[200:] + rels[:24]  # rank 1, padded with rank 0's (as DistributedSampler pads)
    with mounted(image, tmp_path / "mnt", tmp_path / "local", "--prefetch-mb", "2") as m:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            taken = list(pool.map(lambda k: plan.publish(m.mountpoint, [a, b][k], share=k),
                                  [0, 1]))  # fmt: skip
            assert [t.planned for t in taken] == [len(a), len(b)]
            list(pool.map(lambda part: _read_slowly(m, tree, part), [a, b], timeout=120))
        s = plan_status(m)
        reads = m.status()["reader"]["reads"]
        # (The bug: 117 misses of 134 reads. Other processes on the 2 cores delay read-ahead:
        # 24 of 400 missed with four MPI daemons beside, 5 % was too tight.)
        assert s["misses"] <= 0.15 * N_FILES, (s, reads)
        assert s["hits"] + s["pushed_to_kernel"] >= 0.85 * N_FILES, s
        assert s["dropped_unread_bytes"] == 0, s


def test_relative_paths_mean_what_open_makes_of_them(tree: Path, mount: Mount) -> None:
    """A job that runs in its dataset's directory (ImageFolder("c3") from inside the mount)
    plans with paths relative to it; a path outside the mount is refused by name."""
    names = sorted(os.listdir(tree / "c3"))
    script = ("import os, sys\nfrom fanfs import plan\n"
              "t = plan.publish(sys.argv[1], [os.path.join('..', 'c3', n) for n in "
              "sorted(os.listdir('.'))])\nprint(t.planned, t.missing)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script, str(mount.mountpoint)],
                          cwd=mount.mountpoint / "c3", capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(names)), "0"]
    with pytest.raises(PlanRefused, match="not under"):
        plan.publish(mount.mountpoint, [mount.mountpoint / ".." / "elsewhere"])
    taken = plan.publish(mount.mountpoint, ["c3/" + names[0], "c3/nope"])
    assert (taken.planned, taken.missing, taken.first_missing) == (1, 1, "c3/nope")


def test_a_large_plan_never_stalls_reads(tree: Path, mount: Mount) -> None:
    """400,000 paths (each file a thousand times, as sampling with replacement gives): the
    daemon's event loop keeps answering while it takes the plan (it used to freeze for 4 to
    5 s), and a plan over the limit gets a clear refusal (it used to be "Broken pipe")."""
    rels = order(tree, 9)
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            began = time.monotonic()
            os.getxattr(mount.mountpoint, mounts.STATUS_XATTR)  # answered on the event loop
            waits.append(time.monotonic() - began)
            time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.2)
        taken = plan.publish(mount.mountpoint, rels * 1000)
        time.sleep(0.2)
    finally:
        done.set()
        prober.join()
    assert taken.planned == 1000 * N_FILES and taken.missing == 0
    assert max(waits) < 2.5, sorted(waits)[-5:]  # (the bug froze it 4-5 s)
    with pytest.raises(PlanRefused, match="more than this image takes"):
        plan.publish(mount.mountpoint, rels[:1] * ((1 << 20) + 1))
