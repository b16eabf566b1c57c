"""Memory tier: a real daemon under what could make it take unbounded memory, its peak resident
memory (VmHWM) checked against its budgets plus a stated constant (docs/security.md, "Memory").

BASELINE is what an idle daemon holds (the interpreter, numpy, trio, pyfuse3: about 80 MiB
here) plus the native pool's fixed parts (per-thread buffers, its 64 MiB cache of decoded
pieces) and the read-ahead threads' pieces in flight: whatever a plan, an image or a peer asks,
the daemon stays within its budgets plus this."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FANFS, TESTS, fanfs, mounted, prepare, quietest_ticks, wait_until

from fanfs import mounts, plan
from fanfs.bench import launch

MIB = 1 << 20
BASELINE = 300 * MIB  # the stated constant: see the module docstring


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_plan_of_a_huge_compressible_file_stays_within_its_budget(tmp_path: Path) -> None:
    """4 GiB of zeros stores in a few hundred KiB; planned with --prefetch-mb 64, the daemon
    used to decode it whole (about 8 GiB). Read ahead frame by frame up to the budget's share,
    then read back exactly, the daemon's peak stays under 64 MiB + BASELINE."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "zeros.bin", "wb") as f:
        f.truncate(4 << 30)
    image = prepare(src, tmp_path / "img", "--compress", "zstd")
    with mounted(image, tmp_path / "mnt", tmp_path / "local", "--prefetch-mb", "64") as m:
        m.wait_staged()
        os.listdir(m.mountpoint)  # the kernel learns the inode: read-ahead goes to its cache
        assert plan.publish(m.mountpoint, ["zeros.bin"]).planned == 1
        assert wait_until(lambda: m.status()["plan"]["prefetched"] >= 1, 60), m.status()["plan"]
        assert m.status()["plan"]["prefetched_bytes"] <= 64 * MIB
        block = np.zeros(64 * MIB, dtype=np.uint8)
        with open(m.mountpoint / "zeros.bin", "rb", buffering=0) as f:
            total = 0
            while n := f.readinto(block):
                assert not block[:n].any(), total
                total += n
        assert total == 4 << 30
        print(f"peak {peak_rss(m.proc.pid) / MIB:.0f} MiB")
        assert peak_rss(m.proc.pid) < 64 * MIB + BASELINE, peak_rss(m.proc.pid) / MIB


def test_the_piece_cache_keeps_taking_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:  # fmt: skip
    """Files of 3 MiB read in parts keep their decoded piece in the native pool's cache for
    the next part. Once the pieces held filled its bytes while a slot was free, it used to
    refuse every new piece for good: then no part found its file there. 100 files read in
    parts, then another part of the last fifteen: each finds its piece. (Pushes off: else the
    other parts are in the kernel's page cache already, and no READ asks for them.)"""
    monkeypatch.setenv("FANFS_PUSH", "0")
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(1)
    for i in range(100):
        (src / f"f{i:03d}.bin").write_bytes(rng.bytes(3 * MIB))
    image = prepare(src, tmp_path / "img", "--compress", "none")
    with mounted(image, tmp_path / "mnt", tmp_path / "local") as m:
        m.wait_staged()
        names = sorted(p.name for p in src.iterdir())
        for name in names:
            with open(m.mountpoint / name, "rb") as f:
                assert f.read(4096) == (src / name).read_bytes()[:4096]
        before = m.status()["native_frame_hits"]
        for name in reversed(names[-15:]):
            with open(m.mountpoint / name, "rb") as f:
                f.seek(2 * MIB)
                assert f.read(4096) == (src / name).read_bytes()[2 * MIB : 2 * MIB + 4096]
        hits = m.status()["native_frame_hits"] - before
        assert hits >= 15, hits
        print(f"peak {peak_rss(m.proc.pid) / MIB:.0f} MiB")
        assert peak_rss(m.proc.pid) < BASELINE, peak_rss(m.proc.pid) / MIB


@pytest.mark.mpi
def test_a_peer_asking_too_much_gets_refusals_and_no_memory(tmp_path: Path) -> None:
    """A hostile rank asks rank 0 for a whole 200 MiB file (it used to read it into memory)
    and for ten 16 MiB ranges whose replies it never takes (they used to stay in memory until
    exit). Refused beyond MAX_REQUEST and beyond REPLY_BYTES of replies not taken: rank 0's
    peak grows by at most REPLY_BYTES."""
    from fanfs.node.transport.mpi import MAX_REQUEST, REPLY_BYTES

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(2)
    (src / "big.bin").write_bytes(rng.bytes(200 * MIB))
    for i in range(8):
        (src / f"a{i}.bin").write_bytes(rng.bytes(100_000))  # (sorted first: some share
        # the big file's partition, so that rank 0 holds small files too)
    image = prepare(src, tmp_path / "img", "--compress", "none", "--partitions", "4")
    base = tmp_path / "hostile"
    base.mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = ["mpirun", "--oversubscribe", "-np", "1", *FANFS, "mount", str(image), str(mnt),
           "--local", str(tmp_path / "local"), "--linger", "30", ":", "-np", "1",
           sys.executable, str(TESTS / "hostile_peer.py"), str(base)]  # fmt: skip
    with open(tmp_path / "mpirun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **launch.MPI_ENV})  # fmt: skip
    try:
        done = fanfs("wait", mnt, "--timeout", "60", timeout=90)
        assert done.returncode == 0, done.stderr + (tmp_path / "mpirun.log").read_text()
        pid = json.loads(fanfs("status", mnt, "--json").stdout)["pid"]
        before = peak_rss(pid)
        (base / "go").touch()
        assert wait_until(lambda: (base / "result.json").exists(), 90)
        time.sleep(1)
        result = json.loads((base / "result.json").read_text())
        assert result["whole"] == 0  # refused
        taken = [n for n in result["chunks"] if n == MAX_REQUEST]
        assert len(taken) == REPLY_BYTES // MAX_REQUEST, result
        assert all(n in (0, MAX_REQUEST) for n in result["chunks"]), result
        grown = peak_rss(pid) - before
        print(f"before {before / MIB:.0f} MiB, grown {grown / MIB:.0f} MiB")
        assert grown < REPLY_BYTES + 32 * MIB, grown / MIB
        s = json.loads(fanfs("status", mnt, "--json").stdout)["reader"]
        assert s["refused_to_peers"] >= 1 + 10 - len(taken), s
        (base / "done").touch()
        # Batches (planned epochs' fetches): malformed ones dropped unanswered, one asking
        # more than MAX_REQUEST or naming no file refused with an empty reply, a good one of
        # BATCH_MAX files answered with their exact stored bytes.
        assert wait_until(lambda: (base / "batches.json").exists(), 90)
        b = json.loads((base / "batches.json").read_text())
        assert b["small"] > 0 and not b["malformed_reply"], b
        assert b["too_large"] == 0 and b["no_file"] == 0, b
        assert b["good_size"] == b["expected_size"] and b["good_crcs"], b
        # The data plane (fanfs/csrc/plane.c), on its own communicator: malformed asks (one
        # for more than any file stored whole) and a reply to nothing dropped unanswered, asks
        # for the wrong length or no file refused with an empty reply, a good one answered
        # with the exact stored bytes.
        assert wait_until(lambda: (base / "plane.json").exists(), 90)
        p = json.loads((base / "plane.json").read_text())
        assert p["plane"] and not p["malformed_reply"], p
        assert p["answered"] == [0, 0, None], p
        assert p["good_size"] == p["expected_size"] and p["good_crc"], p
        s = json.loads(fanfs("status", mnt, "--json").stdout)["reader"]
        assert s["malformed_messages"] >= 2 + 5, s
        # A message left on the MPI thread's communicator (a tag it never takes): the data
        # plane's look finds it each time and wakes that thread, backing off to 100 ms, so the
        # idle MPI thread still sleeps (at a look a millisecond it spent several % of a core).
        assert wait_until(lambda: (base / "stray").exists(), 90)
        time.sleep(1)
        (spent,) = quietest_ticks([(pid, "fanfs-mpi")], 3)
        assert spent <= os.sysconf("SC_CLK_TCK") * 3 // 100, spent  # at most 1 % of a core
        (base / "bye").touch()
        done = fanfs("umount", mnt, timeout=120)
        assert done.returncode == 0, done.stderr
        assert proc.wait(60) == 0, (tmp_path / "mpirun.log").read_text()
    finally:
        (base / "done").touch()
        (base / "bye").touch()
        launch.stop_process(proc, [mnt])  # type: ignore[arg-type]
        assert mounts.find(mnt) is None


THREAD_BUFFERS = r"""
import os, sys, threading
import numpy as np, zstandard
from fanfs import native
from fanfs.image import filters
from fanfs.native import lib

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

rng = np.random.default_rng(5)
data = rng.random(3 << 18).astype("f4").tobytes()  # 3 MiB: little to compress
stored = zstandard.ZstdCompressor().compress(filters.encode(filters.SHUFFLE4, data))
kind = lib.KIND_FILTER + filters.SHUFFLE4
raw = rng.bytes(3 << 20)
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(stored + raw)
fd = os.open(path, os.O_RDONLY)
crc = native.crc32(stored)
jobs = [(fd, -1, 0, 1, 0, 0, len(data), 0, 0, len(stored), crc, kind, len(data), 0),
        (fd, -1, 1, 2, 0, 0, len(raw), 0, len(stored), len(raw), native.crc32(raw),
         lib.KIND_RAW, len(raw), 0)]
start, go, done = rss(), threading.Barrier(49), threading.Event()

def work():
    assert native.decode(stored, kind, len(data)) == data
    for job in jobs:  # the pool's code: stored bytes and a decoded file in its own buffers
        lib.run_job(job)
    go.wait()
    done.wait()

threads = [threading.Thread(target=work) for _ in range(48)]
for t in threads:
    t.start()
go.wait()
alive = rss() - start
done.set()
for t in threads:
    t.join()
print(alive, rss() - start)
"""


def test_threads_keep_bounded_buffers_and_free_them_as_they_end(tmp_path: Path) -> None:
    """48 threads decode a 3 MiB filtered piece and run the pool's jobs on 3 MiB files: what
    they keep for their next piece is bounded for all of them together (64 MiB), not per
    thread (about 1 GiB at 64 threads), and all of it goes once they end (trio's worker
    threads end after 10 s idle). glibc's mmap threshold is fixed so that freed buffers leave
    the resident memory at once."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    out = subprocess.run([sys.executable, "-c", THREAD_BUFFERS, str(tmp_path / "part")],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    alive, ended = (int(x) for x in out.stdout.split())
    assert alive < 100 * MIB, f"{alive / MIB:.0f} MiB kept by 48 threads"
    assert ended < 16 * MIB, f"{ended / MIB:.0f} MiB left by 48 threads that ended"
