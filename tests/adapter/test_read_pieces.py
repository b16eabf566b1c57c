"""Adapter tier: the read path's pieces alone (cache.py, sources.py), with a fake store and the
in-process transport, no kernel and no mpirun."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np
import parts
import pytest
import trio
import trio.testing

from fanfs import placement
from fanfs.image import catalog as cat
from fanfs.node.cache import ENTRY_OVERHEAD, ByteLRU, SingleFlight
from fanfs.node.sources import PeerServer, Sources
from fanfs.node.store import PartitionStore
from fanfs.node.transport.inproc import Cluster


def test_lru_evicts_least_recent_and_keeps_the_newest() -> None:
    lru = ByteLRU(limit=3 * (100 + ENTRY_OVERHEAD))
    for k in "abc":
        lru.put(k, bytes(100))
    assert lru.get("a") is not None  # a is now the most recent
    lru.put("d", bytes(100))
    assert "b" not in lru and all(k in lru for k in "acd")
    lru.put("c", bytes(50))  # replacing an entry charges only the new bytes
    assert lru.size == 2 * (100 + ENTRY_OVERHEAD) + 50 + ENTRY_OVERHEAD
    lru.put("huge", bytes(10_000))  # alone over the limit: kept, everything else goes
    assert "huge" in lru and len([k for k in "acd" if k in lru]) == 0
    assert lru.peek("huge") is not None and lru.hits == 1


async def test_single_flight_runs_once_and_shares_failure() -> None:
    flights = SingleFlight()
    calls = []
    results: dict[str, bytes] = {}

    release = trio.Event()

    async def produce() -> bytes:
        calls.append(1)
        await release.wait()
        results["k"] = b"done"
        return b"done"

    got: list[bytes] = []

    async def ask() -> None:
        got.append(await flights.run("k", lambda: results.get("k"), produce))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        assert flights.waiters("k") == 4
        release.set()
    assert calls == [1] and got == [b"done"] * 5 and "k" not in flights

    failed = {"bad": False}

    async def fail() -> bytes:
        await trio.sleep(0.05)
        failed["bad"] = True
        raise OSError("disk")

    def lookup() -> None:
        if failed["bad"]:
            raise LookupError("gone bad")

    errors: list[type[BaseException]] = []

    async def ask_bad() -> None:
        try:
            await flights.run("x", lookup, fail)
        except (OSError, LookupError) as e:
            errors.append(type(e))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask_bad)
    assert sorted(e.__name__ for e in errors) == ["LookupError", "LookupError", "OSError"]


class CountingStore(PartitionStore):
    """The real store, counting the reads that reach it."""

    preads = 0

    def pread(self, part: int, offset: int, length: int) -> bytes:
        self.preads += 1
        return super().pread(part, offset, length)

    def pread_cached(self, part: int, offset: int, length: int) -> bytearray | None:
        return None  # always "not in the page cache": every local read goes to pread


@pytest.fixture
def image(awkward_image: Path) -> Path:
    return awkward_image


async def test_sources_choose_local_peer_or_image_and_say_what_is_checked(
    image: Path, tmp_path: Path
) -> None:
    c, _ = cat.Catalog.load(image)
    owners = [(p % 2,) for p in range(c.n_partitions)]  # any placement will do
    stores = [CountingStore(image, c, tmp_path / f"l{r}", placement.owned_by(owners, r))
              for r in range(2)]  # fmt: skip
    locals_ = [parts.local(c, s, r, owners) for r, s in enumerate(stores)]
    cluster = Cluster([PeerServer(c, loc) for loc in locals_], 0.2)
    sources = [Sources(c, loc, owners, t) for loc, t in zip(locals_, cluster.ranks, strict=True)]
    try:
        files = [e for e, _ in c.walk()
                 if c.is_file[e] and c.size[e] and c.codec[e] != cat.CODEC_FRAMED]  # fmt: skip
        mine = next(e for e in files if sources[0].mine(e))
        theirs = next(e for e in files if not sources[0].mine(e))
        for entry, remote in ((mine, False), (theirs, True)):
            n, crc = int(c.stored_len[entry]), int(c.crc[entry])
            data, checked = await sources[0].stored(entry, 0, n, crc)
            assert zlib.crc32(data) == crc and checked is remote
        assert stores[0].preads == 1 and stores[1].preads == 1
        # Without a CRC nothing is checked; a silenced peer sends the reader to the image.
        cluster.silence(1)
        data, checked = await sources[0].stored(theirs, 0, int(c.stored_len[theirs]), None)
        assert not checked and zlib.crc32(data) == int(c.crc[theirs])
        assert sources[0].fallbacks == 1 and stores[0].preads == 2
    finally:
        for s in stores:
            s.close()


def test_status_round_trips_and_refuses_an_unknown_layout() -> None:
    from fanfs.status import (
        CatalogStatus,
        FrontStatus,
        PeerStatus,
        Percentiles,
        PlanStatus,
        ReaderStatus,
        Status,
        StoreStatus,
        render,
    )

    reader = ReaderStatus(1, 2, 3, 4, 5, 6, 7, 0, 1, 0, 2, 5, 4, 1, Percentiles(0.1, 0.2, 0.3, 9),
                          Percentiles(4, 5, 6, 7))  # fmt: skip
    peers = PeerStatus(9, 10, Percentiles(1.0, 2.0, 3.0, 4.0), 0, 4, 3, 5, 0, 0, [2], [1])
    status = Status(7, "/img", "/mnt", 0, 3, 1, "vm", "n1", True, True, True, "isa-l", True, 5, 2,
                    6, 7 << 20, 8, 9, 11, FrontStatus(True, 12, 13, 14, 1, 2, 3, 4, 3, 1,
                                                             Percentiles(0.2, 0.3, 0.4, 0.5)),
                    1.5,
                    CatalogStatus(10, 8, 1000), StoreStatus("/tmp/s", 2, 2, 100, 100, True,
                                                            0.1, 3), reader, peers,
                    PlanStatus(2, 800, 1, 300, 400, 390, 5 << 20, 1 << 20, 10, 2, 0, 0, 1, 1 << 30),
                    "/tmp/s/plan.sock")  # fmt: skip
    flat = status.to_json()
    assert flat["reader"]["remote_fetches"] == 9 and flat["reader"]["fetch_ms_p99"] == 0.3
    assert Status.from_json(flat) == status
    single = dataclasses.replace(status, peers=None)  # one daemon: no peer counters
    assert "remote_fetches" not in single.to_json()["reader"]
    assert Status.from_json(single.to_json()) == single
    assert "remote:" in render(status) and render(status).count("dead peers [2]\n") == 1
    left = dataclasses.replace(status, peers=dataclasses.replace(peers, plane_left=3))
    assert "dead peers [2] (3 transfers with them left to MPI)\n" in render(left)
    assert "native:   13 reads answered in C (11 with no Python;" in render(status)
    assert (
        "piece cache 5 hits / 2 misses; 7.0 MiB pushed to the page cache; 8 direct reads"
    ) in render(status)
    assert "plan:     2 shares, 800 planned (1 missing)" in render(status)
    assert "front:    12 lookups, 13 getattrs, 14 reads answered in C" in render(status)
    assert ("latency:  front (C) p50 0.2 ms, p99 0.4 ms, max 0.5 ms; local p50 0.1 ms, p99 "
            "0.3 ms, max 9 ms; peer p50 1.0 ms, p99 3.0 ms, max 4.0 ms; image p50 4 ms, p99 6 ms, "
            "max 7 ms") in render(status)  # fmt: skip
    assert flat["front"]["read_ms_max"] == 0.5 and flat["reader"]["image_ms_max"] == 7
    assert "4 reads started at lookup (3 read, 1 never)" in render(status)
    broken = dict(flat, reader={k: v for k, v in flat["reader"].items() if k != "reads"})
    with pytest.raises(ValueError, match="not a status"):
        Status.from_json(broken)


def test_lookahead_fetches_while_reads_follow_lookups() -> None:
    from fanfs.node import reader as lookahead
    from fanfs.node.reader import LookAhead

    ahead = LookAhead()
    for entry in range(500):  # a training epoch: every lookup is read
        assert ahead.on
        ahead.looked_up(entry, ahead.on)
        assert ahead.read(entry)
    assert (ahead.fetched, ahead.used, ahead.unused) == (500, 500, 0)
    assert not ahead.read(10**6)  # a file whose dentry the kernel still held: no lookup
    # A stat-only walk (ls -l, du) over many files: fetching stops after a bounded number.
    for entry in range(1000, 3000):
        ahead.looked_up(entry, ahead.on)
    walked = ahead.fetched - 500
    assert not ahead.on and walked <= lookahead.WINDOW + 8, walked
    assert ahead.used == 500 and ahead.unused == walked
    # Reads follow lookups again: measured although nothing is fetched, so fetching resumes.
    entry = 5000
    while not ahead.on:
        ahead.looked_up(entry, ahead.on)
        ahead.read(entry)
        entry += 1
    assert entry - 5000 <= 20 and ahead.fetched == 500 + walked


@pytest.mark.parametrize("q", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("drop_last", [False, True])
def test_locality_sampler_is_a_distributed_sampler(q: float, drop_last: bool) -> None:
    from fanfs.plan import Placement
    from fanfs.torch import LocalitySampler

    rng = np.random.default_rng(4)
    n, nodes, ranks = 1003, 4, 8  # two training ranks per node; uneven node shares
    holders = [(int(h),) for h in rng.choice(nodes, n, p=[0.28, 0.24, 0.24, 0.24])]
    where = Placement(nodes, 0, holders)

    def job(epoch: int) -> list[list[int]]:
        samplers = [LocalitySampler.from_placement(where, q, ranks, r, 9, drop_last)
                    for r in range(ranks)]  # fmt: skip
        for s in samplers:
            s.set_epoch(epoch)
        return [list(s) for s in samplers]

    got = job(0)
    # Exactly DistributedSampler's length, whatever the placement: node 0 holds 28 % of the
    # files, not 25 %, and its surplus goes to the others (an epoch never gets longer).
    length = n // ranks if drop_last else -(-n // ranks)
    assert all(len(g) == length for g in got)
    seen = [i for g in got for i in g]
    if not drop_last:
        assert set(seen) == set(range(n))  # every sample at least once
    assert len(set(seen)) >= (n // ranks) * ranks - ranks
    assert got == job(0) and got != job(1)  # deterministic per epoch, new order each epoch
    sampler = LocalitySampler.from_placement(where, q, ranks, 0, seed=9, drop_last=drop_last)
    share = sampler.remote_share(0)
    if q == 0.0:
        # Only node 0's surplus (about 3 %) is read remotely.
        assert 0.0 < share < 0.05
    if q == 1.0:
        assert abs(share - 0.75) < 0.05  # (N-1)/N, as a global shuffle
