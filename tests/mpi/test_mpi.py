"""MPI tier: real MPI ranks on this machine: `mpirun -np N fanfs mount`, each rank with its own
mount point and local directory ({rank} expansion), every byte compared with the source."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import FANFS, TESTS, prepare, quietest_ticks, stopping, thread_ticks, wait_until

from fanfs import mounts, placement, plan, threads, world
from fanfs.bench import datagen, launch
from fanfs.bench import epoch as global_epoch
from fanfs.bench.compare import assert_same_tree
from fanfs.errors import ExitCode
from fanfs.image import catalog as cat
from fanfs.native import lib
from fanfs.node import reader as lookahead
from fanfs.node.front import FRONT_THREADS

MPIRUN = ["mpirun", "--oversubscribe", "--enable-recovery"]
ENV = {**os.environ, **launch.MPI_ENV}


class MpiMount(launch.Daemons):
    """`mpirun -np N fanfs mount IMAGE base/mnt-{rank} --local base/local-{rank}`."""

    def __init__(self, image: Path, base: Path, n: int, *extra: str):
        super().__init__(image, base / "mnt-{rank}", base / "local-{rank}", n,
                         ["--linger", "20", *extra], log=base / "mpirun.log")  # fmt: skip


def mpi_mounted(
    image: Path, base: Path, n: int, *extra: str
) -> contextlib.AbstractContextManager[MpiMount]:
    return stopping(MpiMount(image, base, n, *extra))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("mpi") / "src"
    datagen.sample(src, n_files=240, classes=6, seed=5)
    rng = np.random.default_rng(9)
    (src / "val").mkdir()
    for i in range(30):
        (src / "val" / f"v{i:02d}.bin").write_bytes(rng.bytes(int(rng.integers(100, 60000))))
    (src / "big").mkdir()
    (src / "big" / "raw-20mib.bin").write_bytes(rng.bytes(20 << 20))  # remote range reads
    (src / "empty").write_bytes(b"")
    os.symlink("val/v00.bin", src / "link")
    # Compressed codec paths over the network: dictionary files and a framed delta4 field.
    (src / "tables").mkdir()
    for i in range(70):
        (src / "tables" / f"t{i:02d}.csv").write_bytes(datagen.csv_table(rng, 40 + i))
    (src / "big" / "field.f32").write_bytes(datagen.smooth_field(rng, 1100, 1100).tobytes())
    return src


@pytest.fixture(scope="module")
def image(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mpi-img") / "img.fanfs"
    return prepare(tree, out, "--compress", "zstd", "--partitions", "32", "--broadcast", "val/**")


def test_prepare_across_ranks_gives_the_same_image(tree: Path, tmp_path: Path) -> None:
    args = ["--partitions", "32", "--broadcast", "val/**"]
    one = prepare(tree, tmp_path / "one", "--jobs", "1", *args)
    done = subprocess.run(
        [*MPIRUN, "-np", "3", *FANFS, "-v", "prepare", "--jobs", "2", *args, str(tree),
         str(tmp_path / "many")],
        env=ENV, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("prepared ") == 1  # one summary, from rank 0
    for rank in (1, 2):  # the other ranks really did part of the work
        assert re.search(rf"rank {rank}: read and compressed [1-9][0-9]* files", done.stderr)
    a, _ = cat.Catalog.load(one)
    b, _ = cat.Catalog.load(tmp_path / "many")
    for name, _dtype in cat.ENTRY_COLUMNS + cat.PARTITION_COLUMNS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.dicts == b.dicts
    for p in range(a.n_partitions):
        name = cat.partition_name(p)
        assert (one / name).read_bytes() == (tmp_path / "many" / name).read_bytes(), name


def test_prepare_across_ranks_fails_cleanly(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(100_000 + i))  # no dictionary samples
    (src / "f07.bin").chmod(0)
    # --jobs 1: rank 0 only walks and writes, so another rank meets the unreadable file. Plain
    # mpirun (as users launch prepare): with --enable-recovery it reports 0 after an abort,
    # though every rank still stops.
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    done = subprocess.run(
        ["mpirun", "--oversubscribe", "-np", "3", *drop, *FANFS, "prepare", "--jobs", "1",
         str(src), str(tmp_path / "img")],
        env=ENV, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == ExitCode.SOURCE, done.stderr
    assert (
        "fanfs: error: " in done.stderr and "f07.bin: cannot read: Permission denied" in done.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no image, no partial one


def _clean_after(m: MpiMount) -> None:
    results = m.umount_all()
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert m.proc.wait(60) == 0, m.log.read_text()
    assert not [p for p in m.mnts if mounts.find(p)]
    assert not [p for p in m.locals if p.exists()]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_rank_reads_every_file(tree: Path, image: Path, tmp_path: Path, n: int) -> None:
    with mpi_mounted(image, tmp_path, n) as m:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            counts = list(pool.map(lambda mnt: assert_same_tree(tree, mnt), m.mnts))
        assert counts == [counts[0]] * n and counts[0] > 270
        for rank in range(n):
            s = m.status(rank)
            assert (s["rank"], s["size"]) == (rank, n)
            if n > 1:
                assert s["reader"]["remote_fetches"] > 0, s
                # Peers' small files come through the front and the data plane, no Python.
                assert s["front"]["remote_fetched"] > 0 and s["front"]["remote_failed"] == 0, s
                assert s["reader"]["plane_fetches"] > 0, s
                assert s["reader"]["served_to_peers"] > 0, s
                # Plain reads for peers never wait for the event loop.
                assert s["reader"]["served_without_event_loop"] > 0, s
                assert s["reader"]["fallbacks"] == 0, s
        _clean_after(m)


def test_without_the_native_remote_path_python_fetches(
    tree: Path, image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FANFS_NATIVE_REMOTE=0: the front hands READs of peers' files to Python, as before."""
    monkeypatch.setenv("FANFS_NATIVE_REMOTE", "0")
    with mpi_mounted(image, tmp_path, 2) as m:
        assert assert_same_tree(tree, m.mnts[0]) > 270
        s = m.status(0)
        assert s["reader"]["remote_fetches"] > 0 and s["front"]["remote_fetched"] == 0, s
        _clean_after(m)


def test_without_the_data_plane_the_mpi_thread_fetches(
    tree: Path, image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FANFS_PLANE=0: the front's fetches and the answers to them go through the MPI thread
    (Python), as before the data plane."""
    monkeypatch.setenv("FANFS_PLANE", "0")
    with mpi_mounted(image, tmp_path, 2) as m:
        assert assert_same_tree(tree, m.mnts[0]) > 270
        s = m.status(0)
        assert s["front"]["remote_fetched"] > 0 and s["front"]["remote_failed"] == 0, s
        assert s["reader"]["plane_fetches"] == 0 and s["reader"]["remote_fetches"] > 0, s
        _clean_after(m)


def test_remote_reads_of_compressed_and_framed_files(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    c, _ = cat.Catalog.load(image)
    rels = ["big/field.f32", "big/raw-20mib.bin", "tables/t03.csv", "tables/t50.csv"]
    entries = [c.resolve(r.encode()) for r in rels]
    assert [cat.CODEC_NAMES[int(c.codec[e])] for e in entries if e is not None] == [
        "framed",
        "framed",
        "zstd-dict",
        "zstd-dict",
    ]
    owners = placement.place(c.part_size, c.part_flags, 2)
    rng = np.random.default_rng(5)
    with mpi_mounted(image, tmp_path, 2) as m:
        for rel, entry in zip(rels, entries, strict=True):
            assert entry is not None
            reader = 1 - owners[int(c.part[entry])][0]  # the rank that does not hold it
            want = (tree / rel).read_bytes()
            before = m.status(reader)["reader"]["remote_fetches"]
            with open(m.mnts[reader] / rel, "rb") as f:
                for off in [0, len(want) - 1, *rng.integers(0, len(want), 25).tolist()]:
                    n = int(rng.choice([1, 4096, 300_000, 2 << 20]))
                    assert os.pread(f.fileno(), n, off) == want[off : off + n], (rel, off, n)
            assert (m.mnts[reader] / rel).read_bytes() == want
            after = m.status(reader)["reader"]
            assert after["remote_fetches"] > before and after["fallbacks"] == 0, (rel, after)
        _clean_after(m)


def test_fetch_at_lookup_and_a_stat_walk(tree: Path, image: Path, tmp_path: Path) -> None:
    """A file opened by path (no listing before, so the kernel sends LOOKUP) is fetched from
    its LOOKUP, once, by the MPI thread for the front (fanfs/csrc/pool.c): the READ waits for
    that fetch and never reaches Python; `ls -l`/`du` look files up without reading them, and
    fetching at LOOKUP stops after a few of those."""
    c, _ = cat.Catalog.load(image)
    owners = placement.place(c.part_size, c.part_flags, 2)
    remote = [c.path(e).decode() for e, _ in c.walk()
              if c.is_file[e] and c.stored_len[e] and c.codec[e] != cat.CODEC_FRAMED
              and 0 not in owners[int(c.part[e])]]  # fmt: skip
    read, walked = remote[:40], remote[40:]
    assert len(walked) > 2 * (lookahead.WINDOW + 8)
    with mpi_mounted(image, tmp_path, 2) as m:
        for rel in read:
            assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes(), rel
        st = m.status(0)
        s, f = st["reader"], st["front"]
        assert f["remote_at_lookup"] == f["lookahead_used"] == len(read), f
        assert f["remote_fetched"] == s["remote_fetches"] == len(read), s  # READ joined the fetch
        assert s["reads"] == 0 and f["remote_failed"] == 0, (s, f)  # no READ reached Python
        # The latency budget has each READ and each fetch's legs, and the owner's side.
        b, owner = st["budget"], m.status(1)
        # (Each READ is added to the budget right after its reply: the last one's may be on
        # its way.)
        assert len(read) - 1 <= b["remote_n"] <= len(read) and b["local_n"] == 0, b
        assert b["remote_peer_ns"] > 0 and b["remote_reply_ns"] > 0, b
        assert b["fetch_n"] == f["remote_fetched"], (b, f)
        assert min(b["fetch_queued_ns"], b["fetch_away_ns"], b["fetch_fill_ns"]) > 0, b
        served = owner["reader"]["served_without_event_loop"]  # (counted before it is sent)
        assert served - 1 <= owner["budget"]["owner_n"] <= served, (owner["budget"], served)
        assert served >= len(read), served
        assert owner["budget"]["owner_read_ns"] > 0 and owner["budget"]["owner_post_ns"] > 0
        for rel in walked:
            os.stat(m.mnts[0] / rel)
        f = m.status(0)["front"]
        assert f["remote_at_lookup"] - len(read) <= lookahead.WINDOW + 8, f
        for rel in walked:  # and every file still reads right
            assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes(), rel
        _clean_after(m)


@pytest.mark.parametrize("plane", ["1", "0"])
def test_a_planned_epoch_reads_remote_files_ahead(
    tree: Path, image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    """Planned epochs over 2 daemons: local and remote files (compressed, with dictionaries)
    read ahead into the page cache, so the job's READs never reach its daemon. A whole plan
    due at once: peers' files come several a turn, asked together through the data plane
    (fanfs_pool_push_files), or in batches through the MPI threads without it."""
    monkeypatch.setenv("FANFS_PLANE", plane)
    rels = sorted(str(p.relative_to(tree)) for p in tree.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.stat().st_size
                  and p.parts[-2] != "big")  # fmt: skip
    random.Random(7).shuffle(rels)
    with mpi_mounted(image, tmp_path, 2) as m:
        for _ in os.walk(m.mnts[0]):  # as a loader that lists its dataset first
            pass
        assert plan.publish(m.mnts[0], rels).planned == len(rels)
        deadline = time.monotonic() + 60
        while (s := m.status(0))["plan"]["prefetched"] < len(rels):
            assert time.monotonic() < deadline, s["plan"]
            time.sleep(0.1)
        assert s["plan"]["pushed_to_kernel"] == len(rels) and s["plan"]["failed"] == 0, s
        r = s["reader"]
        assert r["remote_fetches"] + r["batched_files"] > len(rels) // 4, r  # fetched ahead
        if plane == "1" and lib.plane_built():  # a turn's files asked together, no Python
            assert s["plan"]["pushed_together"] > len(rels) // 8, s["plan"]
            # Each peer's file fetched about once (1.00-1.01): the pieces the 8 pushers ask
            # ahead stay within half the cache (unbounded, they went before their pushes came,
            # which fetched them again: 1.45-1.51 fetches a file; a few still age out).
            fetches = (r["plane_fetches"], s["plan"]["pushed_from_peers"])
            assert s["plan"]["pushed_together"] <= fetches[0] <= fetches[1] * 11 // 10, fetches
            assert r["batch_fetches"] == 0, r
        else:  # several files a round trip, through the MPI threads
            assert 0 < r["batch_fetches"] < r["batched_files"], r
            assert m.status(1)["reader"]["served_to_peers"] >= r["batched_files"], r
        reads = r["reads"]
        for rel in rels:
            assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes(), rel
        # None of those READs reached the daemon: the page cache had them all. (A few may,
        # when the kernel evicts pages under the memory pressure of a full CI run.)
        assert m.status(0)["reader"]["reads"] - reads <= len(rels) // 10
        _clean_after(m)


def test_a_plan_read_ahead_a_file_at_a_time_comes_through_the_data_plane(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    """A budget of 1 MiB: each file the job reads makes room for about one more, so a peer's
    file is alone in its turn, and the data plane fetches it and the C stores it into the
    page cache (no Python on either side). Every byte right, nothing failed."""
    rels = sorted(str(p.relative_to(tree)) for p in tree.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.stat().st_size
                  and p.parts[-2] != "big")  # fmt: skip
    random.Random(8).shuffle(rels)
    with mpi_mounted(image, tmp_path, 2, "--prefetch-mb", "1") as m:
        for _ in os.walk(m.mnts[0]):
            pass
        assert plan.publish(m.mnts[0], rels).planned == len(rels)
        for rel in rels:
            assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes(), rel
        s = m.status(0)
        assert s["plan"]["pushed_from_peers"] > 0 and s["plan"]["failed"] == 0, s["plan"]
        assert s["reader"]["remote_fetches"] >= s["plan"]["pushed_from_peers"], s["reader"]
        assert s["reader"]["plane_fetches"] > 0, s["reader"]
        _clean_after(m)


def test_an_idle_daemon_sleeps(tree: Path, image: Path, tmp_path: Path) -> None:
    """Idle, a daemon's threads sleep: the MPI thread up to 100 ms a turn (the data plane
    looks for its messages and wakes it; at 2 ms a turn it spent 3-4 % of a core), the data
    plane up to 10 ms once quiet for 2 s (at 2 ms: 2-3 %, the whole daemon 2.8 %). A peer's
    file read after the idle spell still comes at once, through either thread."""
    with mpi_mounted(image, tmp_path, 2) as m:
        pids = [m.status(r)["pid"] for r in range(2)]
        time.sleep(3)  # (start-up's traffic over, and 2 s of quiet)
        windows = []  # two of 5 s, the quieter one judged: a busy CI machine once made 10
        for _ in range(2):  # ticks of one (bound 7), where a daemon that polls spends 13-14
            before = [(thread_ticks(p, "fanfs-mpi"), thread_ticks(p)) for p in pids]
            time.sleep(5)
            windows.append([(thread_ticks(p, "fanfs-mpi") - b[0], thread_ticks(p) - b[1])
                            for p, b in zip(pids, before, strict=True)])  # fmt: skip
        spent = [min(w, key=lambda t: t[1]) for w in zip(*windows, strict=True)]
        ticks = os.sysconf("SC_CLK_TCK")
        assert max(s[0] for s in spent) <= ticks * 5 // 100, (spent, ticks)  # 1 % of a core
        assert max(s[1] for s in spent) <= ticks * 5 * 15 // 1000, (spent, ticks)  # 1.5 %
        assert assert_same_tree(tree, m.mnts[0]) > 270  # and the peers answer at once
        _clean_after(m)


def test_every_daemon_thread_is_named(tree: Path, image: Path, tmp_path: Path) -> None:
    """`top -H`, `ps -L`, perf and `fanfs bench`'s CPU by thread tell a daemon's threads apart
    by the names the kernel keeps: each but the main one names itself (fanfs/threads.py and
    the C's prctl), none is left with the process's own name."""
    with mpi_mounted(image, tmp_path, 2) as m:
        assert assert_same_tree(tree, m.mnts[0]) > 270  # local and peers' files
        pid = m.status(0)["pid"]
        names = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                names[int(task.name)] = (task / "comm").read_text().strip()
        kinds = [global_epoch.thread_kind(name, tid == pid, names[pid])
                 for tid, name in names.items()]  # fmt: skip
        assert "other" not in kinds, names
        want = {"loop", "front", "pool", "push", "mpi", "serve", "plan"}
        if lib.plane_built():
            want |= {"plane", "pread"}
        assert want <= set(kinds), names
        _clean_after(m)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """400 small raw files in 16 partitions: one remote fetch per remote file read."""
    src = tmp_path_factory.mktemp("small") / "src"
    rng = np.random.default_rng(12)
    for i in range(400):
        path = src / f"k{i % 10}" / f"s{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(int(rng.integers(100, 20_000))))
    img = tmp_path_factory.mktemp("small-img") / "img"
    return src, prepare(src, img, "--compress", "none", "--partitions", "16")


def test_many_readers_of_peers_files_stay_in_c(small: tuple[Path, Path], tmp_path: Path) -> None:
    """More readers than cores, all reading peers' files at once: each READ waits for its
    piece in a front thread (the front has twice the cores' threads, keeping one for local
    files), none goes to Python. With a thread per core, 6 readers here sent READs to Python
    (the MPI thread's fetch, and its spin) whenever more than 3 waited."""
    src, image = small
    c, _ = cat.Catalog.load(image)
    owners = placement.place(c.part_size, c.part_flags, 2)
    theirs = [c.path(e).decode() for e, _ in c.walk()
              if c.is_file[e] and owners[int(c.part[e])] == (1,)]  # fmt: skip
    readers = FRONT_THREADS - 2
    with mpi_mounted(image, tmp_path, 2) as m:
        with concurrent.futures.ThreadPoolExecutor(readers) as pool:
            got = list(pool.map(lambda rel: (m.mnts[0] / rel).read_bytes(), theirs))
        assert got == [(src / rel).read_bytes() for rel in theirs]
        s = m.status(0)
        assert s["reader"]["reads"] == 0, s["reader"]  # no READ answered by Python
        assert s["front"]["reads"] >= len(theirs) and s["front"]["remote_failed"] == 0, s
        _clean_after(m)


@pytest.mark.parametrize("n", [8, 16])
def test_many_daemons_on_one_machine(small: tuple[Path, Path], tmp_path: Path, n: int) -> None:
    """The protocol beyond 4 ranks (oversubscribed): catalog broadcast, placement, remote
    reads and the linger at unmount, every byte checked."""
    src, image = small
    rels = sorted(str(p.relative_to(src)) for p in src.rglob("*.bin"))
    with mpi_mounted(image, tmp_path, n) as m:
        assert [m.status(r)["size"] for r in range(n)] == [n] * n
        owned = sum(m.status(r)["store"]["partitions_owned"] for r in range(n))
        assert owned == 16
        for r in range(n):  # each rank reads a share, rank 0 everything
            for rel in rels if r == 0 else rels[r::n]:
                assert (m.mnts[r] / rel).read_bytes() == (src / rel).read_bytes(), (r, rel)
        assert m.status(0)["reader"]["remote_fetches"] > 0
        _clean_after(m)


def test_locality_sampler_reads_local_or_as_predicted(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    """q = 0: only the surplus of nodes holding more files than their ranks read (placement
    balances bytes) is remote, as predicted; q = 1: the remote share the sampler predicts,
    within 5 points; every sample read in every epoch, in DistributedSampler's length."""
    from fanfs.torch import LocalitySampler

    src, image = small
    rels = sorted(str(p.relative_to(src)) for p in src.rglob("*.bin"))
    with mpi_mounted(image, tmp_path, 4) as m:
        for q, epoch in ((0.0, 0), (1.0, 1)):
            samplers = [LocalitySampler(rels, m.mnts[r], q, 4, r, seed=1, node_of_rank=range(4))
                        for r in range(4)]  # fmt: skip
            before = [m.status(r)["reader"]["remote_fetches"] for r in range(4)]
            reads = set()
            for r, sampler in enumerate(samplers):
                sampler.set_epoch(epoch)
                got = list(sampler)
                assert len(got) == len(sampler) >= 100
                for i in got:
                    assert (m.mnts[r] / rels[i]).read_bytes() == (src / rels[i]).read_bytes()
                    reads.add((r, i))
            assert {i for _, i in reads} == set(range(len(rels)))
            assert len(samplers[0]) == -(-len(rels) // 4)  # DistributedSampler's length
            fetched = sum(m.status(r)["reader"]["remote_fetches"] - before[r] for r in range(4))
            predicted = samplers[0].remote_share(epoch)
            assert abs(fetched / len(reads) - predicted) < 0.05, (fetched, len(reads))
            if q == 0.0:
                assert predicted < 0.1
            else:
                assert 0.6 < predicted < 0.9
        _clean_after(m)


def test_placement_is_balanced_and_deterministic(tree: Path, tmp_path: Path) -> None:
    # Partitions outnumber ranks at least eightfold and no single file dominates one.
    image = prepare(tree / "train", tmp_path / "img", "--partitions", "32", "--broadcast", "*7.bin")
    c, _ = cat.Catalog.load(image)
    for n in (1, 2, 3, 4):
        owners = placement.place(c.part_size, c.part_flags, n)
        assert owners == placement.place(c.part_size, c.part_flags, n)
        normal = c.part_flags == 0
        load = placement.rank_bytes(
            [o for o, keep in zip(owners, normal, strict=True) if keep], c.part_size[normal], n
        )
        mean = sum(load) / n
        assert max(load) <= 1.10 * mean and min(load) >= 0.90 * mean, load
        for p in np.flatnonzero(~normal):
            assert owners[p] == tuple(range(n))
    two = placement.place(c.part_size, c.part_flags, 3, replicas=2)
    assert all(len(set(o)) == 2 for o, f in zip(two, c.part_flags, strict=True) if not f)


def test_replicas_and_broadcast_set(tree: Path, image: Path, tmp_path: Path) -> None:
    with mpi_mounted(image, tmp_path, 3, "--replicas", "2") as m:
        c, _ = cat.Catalog.load(image)
        n_bcast = int((c.part_flags != 0).sum())
        assert n_bcast >= 1
        owners = placement.place(c.part_size, c.part_flags, 3, replicas=2)
        owned = [m.status(rank)["store"]["partitions_owned"] for rank in range(3)]
        assert owned == [len(placement.owned_by(owners, r)) for r in range(3)]
        assert sum(owned) == 2 * (c.n_partitions - n_bcast) + 3 * n_bcast
        for rank in range(3):  # the broadcast set is read with no remote fetch
            before = m.status(rank)["reader"]["remote_fetches"]
            for f in sorted((tree / "val").iterdir()):
                assert (m.mnts[rank] / "val" / f.name).read_bytes() == f.read_bytes()
            assert m.status(rank)["reader"]["remote_fetches"] == before
        assert_same_tree(tree, m.mnts[1])
        _clean_after(m)


def test_a_stopped_holder_is_hedged_with_a_replica(tree: Path, image: Path,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """Replicas 2 over 3 daemons, one of them stopped (SIGSTOP: it answers nothing, and the
    peer timeout is long): rank 0's reads of files it and rank 2 hold are hedged to rank 2
    after a few milliseconds, not held for the peer timeout."""
    c, _ = cat.Catalog.load(image)
    owners = placement.place(c.part_size, c.part_flags, 3, replicas=2)
    theirs = [c.path(e).decode() for e, _ in c.walk()
              if c.is_file[e] and c.stored_len[e] and c.codec[e] != cat.CODEC_FRAMED
              and set(owners[int(c.part[e])]) == {1, 2}]  # fmt: skip
    assert len(theirs) >= 10
    with mpi_mounted(image, tmp_path, 3, "--replicas", "2", "--peer-timeout", "60") as m:
        victim = m.status(1)["pid"]
        os.kill(victim, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for rel in theirs:
                assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes(), rel
            took = time.monotonic() - started
            s = m.status(0)["reader"]
        finally:
            os.kill(victim, signal.SIGCONT)
        assert took < 20, took  # not one peer timeout (60 s), let alone one per file
        assert s["hedged"] >= 1 and s["hedges_won"] >= 1 and s["dead_peers"] == [], s
        _clean_after(m)


def test_readers_of_a_silent_peer_never_freeze_the_mount(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    """Rank 1 stopped (SIGSTOP: silent, the peer timeout long): more readers of its files than
    the front has threads wait for it at once, and the local files still read at once (a front
    thread is always left for them: the others' READs wait in Python, not in the front)."""
    c, _ = cat.Catalog.load(image)
    owners = placement.place(c.part_size, c.part_flags, 2)
    files = [(c.path(e).decode(), owners[int(c.part[e])]) for e, _ in c.walk()
             if c.is_file[e] and c.stored_len[e] and c.codec[e] != cat.CODEC_FRAMED]  # fmt: skip
    theirs = [rel for rel, o in files if o == (1,)][: 2 * FRONT_THREADS]
    mine = [rel for rel, o in files if 0 in o][:40]
    with mpi_mounted(image, tmp_path, 2, "--peer-timeout", "30") as m:
        victim = m.status(1)["pid"]
        os.kill(victim, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(theirs)) as pool:
                stuck = [pool.submit((m.mnts[0] / rel).read_bytes) for rel in theirs]
                time.sleep(1)  # every front thread that may wait is waiting now
                assert not any(f.done() for f in stuck)
                started = time.monotonic()
                for rel in mine:
                    assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes(), rel
                took = time.monotonic() - started
                os.kill(victim, signal.SIGCONT)
                for rel, f in zip(theirs, stuck, strict=True):
                    assert f.result(timeout=60) == (tree / rel).read_bytes(), rel
        finally:
            os.kill(victim, signal.SIGCONT)
        assert took < 10, took  # not held for the peer timeout (30 s)
        _clean_after(m)


def _epoch(src: Path, mnt: Path, seed: int) -> int:
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    random.Random(seed).shuffle(files)
    for rel in files:
        assert (mnt / rel).read_bytes() == (src / rel).read_bytes(), rel
    return len(files)


def test_sigkill_mid_epoch_survivors_finish(tree: Path, image: Path, tmp_path: Path) -> None:
    with mpi_mounted(image, tmp_path, 4, "--peer-timeout", "2") as m:
        victim = m.status(2)["pid"]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            started = time.monotonic()
            epochs = [pool.submit(_epoch, tree, m.mnts[r], r) for r in (0, 1, 3)]
            time.sleep(0.3)  # mid-epoch
            os.kill(victim, signal.SIGKILL)
            counts = [e.result(timeout=120) for e in epochs]
        assert time.monotonic() - started < 90
        assert counts[0] > 270
        stats = [m.status(r)["reader"] for r in (0, 1, 3)]
        assert all(s["dead_peers"] == [2] for s in stats if s["peer_timeouts"]), stats
        assert sum(s["fallbacks"] for s in stats) > 0, stats
        # Idle now, the survivors' MPI threads sleep: the dead rank's quarantined reply tags
        # (drained for ten peer timeouts) kept each one polling hot, at 26-53 % of a core.
        pids = [m.status(r)["pid"] for r in (0, 1, 3)]
        time.sleep(1)
        spent = quietest_ticks([(pid, "fanfs-mpi") for pid in pids], 3)
        assert max(spent) <= os.sysconf("SC_CLK_TCK") * 3 * 5 // 100, spent  # 5 % of a core
        results = m.umount_all()  # the dead rank's stale mount included
        assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
        assert not [p for p in m.mnts if mounts.find(p)]
        m.proc.wait(60)
        assert not [p for p in m.locals if p.exists() and p != m.locals[2]]


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie has: its memory is gone)."""
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or between open and read
        return True


@contextlib.contextmanager
def _beside_a_dying_peer(tmp_path: Path, before: list[str], after: list[str], *mode: str,
                         idle: float) -> Iterator[Path]:  # fmt: skip
    """`mpirun -np 1 fanfs BEFORE... MNT --local LOCAL AFTER... : -np 1 python
    tests/dying_peer.py BASE MODE...`: once rank 0 is up and has been idle `idle` s, the peer
    is told to go, and it has died when MNT is yielded. Then `fanfs umount` must end rank 0."""
    base, mnt = tmp_path / "peer", tmp_path / "mnt"
    base.mkdir()
    mnt.mkdir()
    cmd = [*MPIRUN, "-np", "1", *FANFS, *before, str(mnt), "--local", str(tmp_path / "local"),
           *after, ":", "-np", "1", sys.executable, str(TESTS / "dying_peer.py"), str(base),
           *mode]  # fmt: skip
    with open(tmp_path / "mpirun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        done = subprocess.run([*FANFS, "wait", str(mnt), "--timeout", "60"], timeout=90,
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr + (tmp_path / "mpirun.log").read_text()
        peer = int((base / "pid").read_text())
        time.sleep(idle)  # rank 0's threads sleep long: they find the messages after the kill
        (base / "go").touch()
        assert wait_until(lambda: _gone(peer), 30)
        time.sleep(0.5)
        yield mnt
        done = subprocess.run([*FANFS, "umount", str(mnt), "--timeout", "30"], timeout=60,
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr + (tmp_path / "mpirun.log").read_text()
        proc.wait(60)
    finally:
        launch.stop_process(proc, [mnt])
    assert mounts.find(mnt) is None


def test_a_peer_killed_mid_send_leaves_the_daemon_serving(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    """tests/dying_peer.py leaves replies of rank 0's untaken, starts sending rank 0 two
    messages of 1 MiB, one to its MPI thread and one to its data plane, and is killed before
    rank 0 takes them: neither those receives nor the replies' sends ever end (Open MPI). Each
    thread used to wait on a receive for good (remote reads hung after the peer timeout, the
    daemon never exited: the sigkill test's unmount failed 2 runs in 5), and the MPI thread
    polled hot for ever while a send was under way. Now every file reads back right (rank 1's
    from the image), the idle threads sleep, the data plane leaves its receive and its send
    to MPI after ten peer timeouts, and the unmount ends."""
    args = ["--peer-timeout", "0.5", "--linger", "5"]  # (ten peer timeouts: 5 s)
    with _beside_a_dying_peer(tmp_path, ["mount", str(image)], args, idle=3) as mnt:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert pool.submit(_epoch, tree, mnt, 0).result(timeout=90) > 270
        s = mounts.probe_status(mnt, 10)
        assert s is not None and s["reader"]["dead_peers"] == [1], s
        # (Both messages matched, then dropped: not what was asked.)
        assert s["reader"]["malformed_messages"] >= 1 + lib.plane_built(), s["reader"]
        time.sleep(1)
        spent = quietest_ticks([(s["pid"], "fanfs-mpi"), (s["pid"], "fanfs-plane")], 3)
        assert max(spent) <= os.sysconf("SC_CLK_TCK") * 3 * 5 // 100, spent  # 5 %
        if lib.plane_built():  # the 1 MiB it never finished sending, the reply never taken
            left = lambda: mounts.probe_status(mnt, 10)["reader"]["plane_left"]  # noqa: E731
            assert wait_until(lambda: left() >= 2, 10), left()


def test_a_partner_killed_mid_send_leaves_the_output_daemon_landing(tmp_path: Path) -> None:
    """An output mount with --replicas 2 whose partner (tests/dying_peer.py) starts a message
    of 1 MiB to it and is killed before it is taken: the receive never ends (Open MPI). The
    replicas thread waited on it for good: the unmount failed (the daemon never exited). Now a
    file written after lands byte for byte and the unmount ends."""
    dest = tmp_path / "dest"
    dest.mkdir()
    payload = os.urandom(1 << 20)
    args = ["--replicas", "2", "--peer-timeout", "2"]
    with _beside_a_dying_peer(tmp_path, ["output", str(dest)], args, "output", idle=1) as mnt:
        (mnt / "ckpt.pt").write_bytes(payload)
    assert (dest / "ckpt.pt").read_bytes() == payload


def test_dead_owner_and_no_image_give_eio_not_a_hang(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "img-copy"
    shutil.copytree(image, copy)
    with mpi_mounted(copy, tmp_path / "m", 2, "--peer-timeout", "2") as m:
        deadline = time.monotonic() + 30
        while not all(m.status(r)["store"]["staging_done"] for r in (0, 1)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(m.status(1)["pid"], signal.SIGKILL)
        copy.rename(tmp_path / "img-gone")  # shared storage unreachable too
        c, _ = cat.Catalog.load(tmp_path / "img-gone")
        owners = placement.place(c.part_size, c.part_flags, 2)
        theirs = [
            e for e, _ in c.walk() if c.is_file[e] and c.size[e] and owners[c.part[e]] == (1,)
        ]
        mine = [e for e, _ in c.walk() if c.is_file[e] and 0 in owners[c.part[e]]]
        started = time.monotonic()
        for e in theirs[:5]:
            with pytest.raises(OSError) as err:
                (m.mnts[0] / os.fsdecode(c.path(e))).read_bytes()
            assert err.value.errno == 5
        assert time.monotonic() - started < 30
        for e in mine[:20]:
            rel = os.fsdecode(c.path(e))
            assert (m.mnts[0] / rel).read_bytes() == (tree / rel).read_bytes()
        assert m.umount_all()[0].returncode == 0


def test_unmounting_one_node_keeps_serving_the_others(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    # (A linger longer than the test: 20 s could run out under a loaded machine's epoch.)
    with mpi_mounted(image, tmp_path, 2, "--peer-timeout", "1", "--linger", "120") as m:
        first = subprocess.Popen([*FANFS, "umount", str(m.mnts[0]), "--timeout", "60"])
        try:
            deadline = time.monotonic() + 20
            while mounts.find(m.mnts[0]):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(3)  # several peer timeouts: rank 0 must still serve its share
            _epoch(tree, m.mnts[1], 0)
            s = m.status(1)["reader"]
            assert s["remote_fetches"] > 0 and s["fallbacks"] == 0 and s["dead_peers"] == [], s
            assert first.poll() is None  # rank 0 lingers while rank 1 is mounted
        finally:
            _clean_after(m)
            assert first.wait(30) == 0
        assert "routing around" not in m.log.read_text()


def test_a_node_unmounted_alone_is_done_once_it_stops_serving(
    tree: Path, image: Path, tmp_path: Path
) -> None:
    """`fanfs umount` of one node while its peers stay mounted: once its linger is over and it
    has cleaned up, all that is left is MPI's finalize, which waits for the other ranks. The
    unmount says so and exits 0 (it used to wait its whole --timeout, then fail: exit 6)."""
    with mpi_mounted(image, tmp_path, 2, "--linger", "1") as m:
        pid = m.status(0)["pid"]
        done = launch.run("umount", m.mnts[0], "--timeout", "30", timeout=60)
        assert done.returncode == 0, done.stderr + m.log_text()
        assert "has finished and ends once the job's other" in done.stderr, done.stderr
        assert mounts.find(m.mnts[0]) is None and not m.locals[0].exists()
        assert threads.finalizing(pid) and m.proc.poll() is None  # waits for rank 1
        _epoch(tree, m.mnts[1], 1)  # rank 1 still reads everything (from the image)
        _clean_after(m)


def test_a_signal_while_lingering_stops_the_wait(tree: Path, image: Path, tmp_path: Path) -> None:
    """A rank whose mount went away (unmounted from outside) lingers for its peers; a SIGTERM
    then ends the wait: it cleans up its staging at once (it used to segfault there, leaving
    it) and, once its peers are done, the job exits 0."""
    with mpi_mounted(image, tmp_path, 2, "--peer-timeout", "2") as m:
        pid = m.status(0)["pid"]
        subprocess.run(["fusermount3", "-u", "-z", str(m.mnts[0])], check=True, timeout=10)
        assert wait_gone(m.mnts[0])
        time.sleep(0.5)  # lingering now: rank 1 is still mounted
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while m.locals[0].exists() and any(m.locals[0].iterdir()):
            assert time.monotonic() < deadline, "rank 0 kept its staging directory"
            time.sleep(0.1)
        _epoch(tree, m.mnts[1], 1)  # rank 1 still reads everything (from the image if need be)
        _clean_after(m)
        assert "Segmentation" not in m.log.read_text()


def wait_gone(mountpoint: Path, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while mounts.find(mountpoint):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- the MPI thread's receives, with a fake MPI ------------------------------------------------


class _FakeMPI:
    """What Inbox uses of mpi4py's MPI: a receive that MPI completes `after` tests after the
    test lets its transfer go on (`going`), or never."""

    BYTE = 1

    class Exception(Exception):  # (mpi4py's name)
        pass

    class Request:
        def __init__(self, after: int | None) -> None:
            self.after, self.cancelled, self.going = after, False, False

        def Test(self) -> bool:
            if not self.going or self.after is None:
                return False
            self.after -= 1
            return self.after < 0

        def Cancel(self) -> None:
            self.cancelled = True

        @staticmethod
        def Testall(reqs: list[_FakeMPI.Request]) -> bool:
            return all([r.Test() for r in reqs])


class _FakeComm:
    def __init__(self, size: int, after: int | None) -> None:
        self.size, self.after, self.sent = size, after, False
        self.requests: list[weakref.ref[_FakeMPI.Request]] = []

    def Improbe(self, source: int, tag: int, status: _FakeStatus) -> object | None:
        if self.sent:
            return None
        self.sent = True
        status.count = self.size
        comm = self

        class Message:
            def Irecv(self, buf: memoryview) -> _FakeMPI.Request:
                req = _FakeMPI.Request(comm.after)
                comm.requests.append(weakref.ref(req))
                return req

        return Message()


class _Buffer(bytearray):
    """A fetch's buffer that a weak reference can watch."""


class _FakeStatus:
    count = 0

    def Get_count(self, datatype: int) -> int:
        return self.count


@pytest.mark.parametrize("after", [3, None])
def test_a_receive_given_up_is_kept_until_mpi_is_done(after: int | None) -> None:
    """A fetch given up for good (its quarantine over) or a stop with a receive still active:
    the receive and its buffer stay referenced while MPI may still write into it (at the
    stop, a receive MPI never completes is kept for good). It is not cancelled: its message
    is matched, and a cancelled matched receive may put it back for a later fetch's tag."""
    from fanfs.node.transport import inbox as ib

    released: list[int] = []
    comm = _FakeComm(1000, after)
    box = ib.Inbox(comm, _FakeMPI, 0.0, lambda job, n: None, released.append, lambda: None)
    job = ib.Fetch(peer=1, length=1000, buf=_Buffer(1000))
    buf = weakref.ref(job.buf)
    box.expect(16, job)
    status = _FakeStatus()
    assert box.take_all(status)  # the reply is matched, its receive under way
    box.forget(16)  # the fetch gives up (quarantined); its peer timeout is 0
    del job
    time.sleep(0.01)
    box.take_all(status)  # the quarantine is over: the tag is free again
    assert released == [16]
    gc.collect()
    req = comm.requests[0]()
    assert req is not None and not req.cancelled, "an active receive was let go, or cancelled"
    assert buf() is not None, "the buffer of an active receive was freed"
    req.going = True
    del req
    box.take_all(status)
    box.close()  # the stop: a transfer that ends completes, one that never does is kept
    gc.collect()
    if after is None:
        assert comm.requests[0]() is not None and buf() is not None
        assert any(r is comm.requests[0]() for r, _ in world.LEFT_TO_MPI)
        world.LEFT_TO_MPI.clear()
    else:
        assert comm.requests[0]() is None and buf() is None


DIES_AT_START = "from mpi4py import MPI; import os; os._exit(3)"  # dead once MPI began


def _start_up_daemons(base: Path) -> list[int]:
    """The `fanfs mount` ranks under `base` whose MPI has begun (its threads exist: the stop
    signals are taken by then)."""
    found = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (d / "cmdline").read_bytes().split(b"\0")
            ours = argv[2:3] == [b"mount"] and any(str(base).encode() in a for a in argv)
            if ours and len(list((d / "task").iterdir())) > 1:
                found.append(int(d.name))
    return found


@pytest.mark.parametrize("ending", ["timeout", "signal"])
def test_a_rank_dead_at_start_up_ends_the_others_start(
    image: Path, tmp_path: Path, ending: str
) -> None:
    """A rank that dies at start-up (or never starts) leaves every start-up collective
    unfinished: its peers waited in one for good, deaf to SIGTERM (a Python handler runs
    between bytecodes), a core each; a Slurm job's output step did, its rank 0 killed by a
    segfault. The wait now ends at FANFS_START_TIMEOUT, or a few seconds after a stop signal,
    with one line from each rank; nothing is left mounted or staged."""
    mnts = [tmp_path / f"mnt-{r}" for r in range(2)]
    for m in mnts:
        m.mkdir()
    cmd = [*MPIRUN, "-np", "2", *FANFS, "mount", str(image), str(tmp_path / "mnt-{rank}"),
           "--local", str(tmp_path / "local-{rank}"), ":", "-np", "1", sys.executable, "-c",
           DIES_AT_START]  # fmt: skip
    env = {**ENV, "FANFS_START_TIMEOUT": "5" if ending == "timeout" else "600"}
    log = tmp_path / "mpirun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        if ending == "signal":
            assert wait_until(lambda: len(_start_up_daemons(tmp_path)) == 2, 60), log.read_text()
            time.sleep(1)  # (in a start-up collective, waiting for the dead rank)
            for pid in _start_up_daemons(tmp_path):
                os.kill(pid, signal.SIGTERM)
        began = time.monotonic()
        proc.wait(90)
        assert time.monotonic() - began < 60, log.read_text()
    finally:
        launch.stop_process(proc, mnts)
    text = log.read_text()
    line = ("waited 5 s for the other ranks at start-up" if ending == "timeout"
            else "stopped by SIGTERM before serving")  # fmt: skip
    assert text.count(line) == 2, text
    assert not [m for m in mnts if mounts.find(m)]
    assert not list(tmp_path.glob("local-*/fanfs-stage-*"))


# A third rank that follows the daemons' start-up collectives (fanfs.world's own calls) and
# says what argv[2] asks: at their first agreement, a pickle that, unpickled, would create the
# file argv[1], or a JSON verdict no daemon sends; or, as rank 0, a catalog of 2^60 bytes.
HOSTILE_AT_START = """import pickle, struct, sys
from fanfs.world import World

class Evil:
    def __reduce__(self):
        return (open, (sys.argv[1], "w"))

w = World(60)
MPI = w.MPI
w.bcast(None)  # rank 0's verdict on the image
if sys.argv[2] == "size":  # rank 0: the catalog's size, and no catalog
    w.comm.Ibcast([bytearray(struct.pack("<q", 1 << 60)), MPI.BYTE], root=0).Wait()
    sys.exit(0)
w.bcast_bytes(None)  # the catalog
data = pickle.dumps(Evil()) if sys.argv[2] == "pickle" else b"[999, 5]"
mine, sizes = bytearray(struct.pack("<q", len(data))), bytearray(8 * w.size)
w.comm.Iallgather([mine, MPI.BYTE], [sizes, MPI.BYTE]).Wait()
counts = list(struct.unpack(f"<{w.size}q", sizes))
out = bytearray(sum(counts))
displs = [sum(counts[:r]) for r in range(w.size)]
w.comm.Iallgatherv([data, MPI.BYTE], [out, (counts, displs), MPI.BYTE]).Wait()
"""
HOSTILE_SAYS = {
    "pickle": "rank 2 sent a start-up message that is not fanfs's",
    "shape": "rank 2 sent a start-up verdict that is not fanfs's",
    "size": "rank 0 announced 1152921504606846976 bytes: more than this rank can hold",
}


@pytest.mark.parametrize("says", sorted(HOSTILE_SAYS))
def test_a_hostile_rank_at_start_up_is_read_as_data(image: Path, tmp_path: Path, says: str) -> None:
    """A peer daemon's messages are checked like input, the start-up collectives' too: they
    carry JSON, so a rank's pickle (which, unpickled, runs what it names) and a verdict of the
    wrong shape each end every daemon's start with one line naming the rank, and so does a
    catalog larger than a rank can hold (a MemoryError's traceback before); nothing runs,
    nothing is left mounted or staged."""
    ranks = [1, 2] if says == "size" else [0, 1]  # (the hostile rank is rank 0 or 2)
    mnts = [tmp_path / f"mnt-{r}" for r in ranks]
    for m in mnts:
        m.mkdir()
    marker = tmp_path / "ran"
    daemons = ["-np", "2", *FANFS, "mount", str(image), str(tmp_path / "mnt-{rank}"),
               "--local", str(tmp_path / "local-{rank}")]  # fmt: skip
    hostile = ["-np", "1", sys.executable, "-c", HOSTILE_AT_START, str(marker), says]
    first, then = (hostile, daemons) if says == "size" else (daemons, hostile)
    cmd = [*MPIRUN, *first, ":", *then]
    log = tmp_path / "mpirun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV)
    try:
        proc.wait(90)
    finally:
        launch.stop_process(proc, mnts)
    text = log.read_text()
    assert not marker.exists(), text  # (mpirun's own code: 0, with --enable-recovery)
    assert text.count(HOSTILE_SAYS[says]) == 2, text
    assert not [m for m in mnts if mounts.find(m)]
    assert not list(tmp_path.glob("local-*/fanfs-stage-*"))
