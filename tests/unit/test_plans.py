"""Unit tier: planned epochs' state (fanfs/node/plans.py) and the paths it is given
(fanfs/image/paths.py), without a mount: where the job is in a plan with repeats, in several shares,
with reads that lag behind what the sampler drew; what is due within a budget of decoded
bytes."""

from __future__ import annotations

import random
import stat
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fanfs.image import catalog as cat
from fanfs.image import paths
from fanfs.node import plansocket
from fanfs.node.order import PARTIAL_SHARE, ShareOrder, read_ahead_bytes
from fanfs.node.plans import MIN_WINDOW, Plans

N = 1000  # entries of the fake catalog
KIB = 1 << 10


def fake_catalog(n: int = N) -> Any:
    return SimpleNamespace(n_entries=n)


def plans_with(*orders: list[int], budget: int = 1 << 40, cost: int = KIB) -> Plans:
    p = Plans(fake_catalog(), budget)
    for share, order in enumerate(orders):
        o = np.array(order, dtype=np.int64)
        p.install(share, ShareOrder.build(o, np.full(len(o), cost)))
    return p


def test_a_repeat_later_in_the_plan_never_moves_the_position_there() -> None:
    """LocalitySampler and DistributedSampler pad a rank with its own first samples: entry 5
    is at position 0 and again at 990. Its READ at the start is position 0, not 990."""
    order = [5, *range(10, 1000)]
    order[990] = 5
    p = plans_with(order)
    p.accessed(5, False)
    assert p.shares[0].position == 1
    for pos in range(1, 990):
        p.accessed(order[pos], True)
    assert p.shares[0].position == 990
    p.accessed(5, None)  # the repeat, when the job gets there
    assert p.shares[0].position == 991


def test_a_repeat_is_read_ahead_once() -> None:
    order = ShareOrder.build(np.array([3, 4, 3, 3, 5]), np.full(5, KIB))
    assert order.cost.tolist() == [KIB, KIB, 0, 0, KIB]
    assert order.occurrence(3, 1) == 2 and order.occurrence(3, 4) is None
    assert order.occurrence(9, 0) is None


def test_several_shares_naming_a_file_move_the_nearest() -> None:
    """Ranks of one node share padding: entry 7 is at position 2 of share 0 and 500 of share
    1, whose jobs are both near their starts. The READ moves share 0 only."""
    a = list(range(0, 600))
    b = list(range(600, 1000)) + list(range(0, 200))
    a[2], b[500] = 7, 7
    p = plans_with(a, b)
    p.accessed(7, False)
    assert (p.shares[0].position, p.shares[1].position) == (3, 0)


def test_reads_behind_the_drawn_position_count_and_keep_their_bytes() -> None:
    """A DataLoader draws `workers x prefetch x batch` indices before it reads them: progress
    says 300, then 700, while reads come from 0 on. The lag is learnt from the reads, the
    bytes held for what is drawn but not read are kept, reads never move the position back."""
    order = list(range(N))
    p = plans_with(order)
    s = p.shares[0]
    for pos in range(0, 450):
        assert p.hold(0, s, pos, order[pos], b"x" * 10)
    p.progress(0, 300)
    for pos in range(0, 300):
        assert p.read(order[pos], 0, 10) is not None, pos  # the job reads what it drew
    assert s.lag == 300 and s.window == 600 and s.position == 300
    p.progress(0, 700)
    for pos in range(300, 450):
        assert p.read(order[pos], 0, 10) is not None, pos
    assert s.position == 700 and p.held_bytes == 0 and p.dropped_unread_bytes == 0
    assert p.hits == 450 and p.misses == 0


def test_held_bytes_the_reads_went_past_are_dropped() -> None:
    order = list(range(N))
    p = plans_with(order)
    s = p.shares[0]
    for pos in range(0, 450):
        assert p.hold(0, s, pos, order[pos], b"x" * 10)
    for pos in [*range(0, 20), *range(400, 450)]:  # the job skips 20..399
        assert p.read(order[pos], 0, 10) is not None
    assert s.read_floor == 450 - MIN_WINDOW
    assert p.dropped_unread_bytes == 10 * (450 - MIN_WINDOW - 20)
    assert p.held_bytes == 10 * (400 - (450 - MIN_WINDOW))


def test_a_file_read_is_not_held_again_when_its_position_is_read_ahead_again() -> None:
    """To make room, held bytes further ahead give way and their positions are read ahead
    again, with every position after them: one the job has read since must not be held
    again (its READ has been: the bytes would wait for ever; a flaky end of
    test_a_planned_epoch_keeps_the_front_answering)."""
    order = list(range(N))
    p = plans_with(order)
    s = p.shares[0]
    assert p.hold(0, s, 5, order[5], b"x" * 10)
    assert p.read(order[5], 0, 10) is not None and p.held_bytes == 0
    assert not p.hold(0, s, 5, order[5], b"x" * 10)  # read ahead again: not held
    assert p.held_bytes == 0


def test_a_file_the_job_read_first_is_not_read_ahead_any_more() -> None:
    """The job's READs overtook the read-ahead: files 20-29 were read (the front answered
    them) before their turn came. A read-ahead of them still queued is not wanted, `due`
    passes them over, and the next epoch's plan reads them ahead again. (Once overtaken, the
    pushers fetched each such file again: 1.6 fetches a peer's file in a global epoch.)"""
    order = list(range(100))
    p = plans_with(order, budget=10 * KIB)
    s = p.shares[0]
    assert [d[2] for d in p.due(1000)] == list(range(10))
    for entry in range(20, 30):
        p.answered(entry)
    assert not p.current(0, s, 25) and p.current(0, s, 30)
    p.accessed(15, True)  # read ahead in time: still a file the read-ahead stored
    assert p.current(0, s, 15)
    assert [d[2] for d in p.due(1000)] == list(range(10, 20))
    assert [d[2] for d in p.due(1000)] == list(range(30, 40))  # 20-29 passed over
    p.install(0, ShareOrder.build(np.array(order), np.full(100, KIB)))  # the next epoch
    assert [d[2] for d in p.due(1000)] == list(range(10))


def test_due_stays_within_the_budget_of_decoded_bytes() -> None:
    p = plans_with(list(range(100)), budget=10 * KIB)
    due = p.due(1000)
    assert len(due) == 10 and sum(d[4] for d in due) == 10 * KIB
    assert p.due(1000) == []  # nothing more until the job moves
    p.progress(0, 5)
    assert [d[2] for d in p.due(1000)] == list(range(10, 15))
    two = plans_with(list(range(100)), list(range(100, 200)), budget=10 * KIB)
    assert len(two.due(1000)) == 10  # two shares split it


def test_due_passes_over_a_bounded_number_of_empty_positions_per_call() -> None:
    """One file drawn 10,000 times: only its first draw costs anything. Each call passes over
    at most `limit` empty positions and says that it stopped (a daemon's event loop froze for a
    second in one call over 400,000 of them); the calls together reach the plan's end."""
    order = [7] * 10_000
    p = plans_with(order)
    first = p.due(256)
    assert [d[2] for d in first] == [0] and p.scanning
    calls = 1
    while p.scanning:
        assert p.due(256) == []
        calls += 1
    assert calls == -(-(len(order) - 1) // 256)  # 256 empty positions a call
    assert p.shares[0].next == len(order)


def test_held_bytes_stay_within_the_budget() -> None:
    p = plans_with(list(range(100)), budget=3 * KIB)
    s = p.shares[0]
    assert p.hold(0, s, 0, 0, bytes(2 * KIB))
    assert not p.hold(0, s, 1, 1, bytes(2 * KIB))  # no room: its READ fetches it
    assert p.held_bytes == 2 * KIB


def test_a_new_plan_for_a_share_drops_what_the_old_one_held() -> None:
    p = plans_with([1, 2, 3])
    assert p.hold(0, p.shares[0], 1, 2, b"abc")
    p.install(0, ShareOrder.build(np.array([4, 5]), np.full(2, KIB)))
    assert p.held_bytes == 0 and p.dropped_unread_bytes == 3 and not p.has(2)
    assert p.read(2, 0, 3) is None  # the old plan's file: not planned any more


def test_read_ahead_bytes_are_decoded_bytes_and_framed_files_only_begin() -> None:
    size = np.array([0, 100, 50 << 20, 4 << 30, 20 << 20, 10], dtype=np.uint64)
    codec = np.array([cat.CODEC_RAW, cat.CODEC_ZSTD, cat.CODEC_FRAMED, cat.CODEC_FRAMED,
                      cat.CODEC_RAW, cat.CODEC_RAW], dtype=np.uint8)  # fmt: skip
    is_file = np.array([True, True, True, True, True, False])
    c = SimpleNamespace(size=size, codec=codec, is_file=is_file, frame_size=1 << 20)
    got = read_ahead_bytes(c, np.arange(6), budget=64 << 20, whole_limit=16 << 20)
    assert got.tolist() == [0, 100, (64 << 20) // PARTIAL_SHARE, (64 << 20) // PARTIAL_SHARE,
                            0, 0]  # fmt: skip


# -- paths -------------------------------------------------------------------------------------


def tree_catalog(names: list[bytes]) -> cat.Catalog:
    """A real catalog (every invariant checked) of files at `names` (relative paths)."""
    entries: dict[bytes, list[bytes]] = {b"": []}
    for name in sorted(set(names)):
        parts = name.split(b"/")
        for k in range(1, len(parts)):
            d = b"/".join(parts[:k])
            if d not in entries:
                entries[d] = []
                entries[b"/".join(parts[: k - 1])].append(d)
        entries[b"/".join(parts[:-1])].append(name)
    order, queue = [b""], [b""]
    kids: dict[bytes, tuple[int, int]] = {}
    while queue:  # breadth first: each directory's children contiguous, sorted by name
        d = queue.pop(0)
        children = sorted(set(entries[d]), key=lambda p: p.rsplit(b"/", 1)[-1])
        kids[d] = (len(order), len(children))
        order += children
        queue += [c for c in children if c in entries]
    index = {p: i for i, p in enumerate(order)}
    strings = bytearray()
    cols: dict[str, list[int]] = {k: [] for k, _ in cat.ENTRY_COLUMNS}
    for p in order:
        leaf = p.rsplit(b"/", 1)[-1]
        is_dir = p in entries
        parent = index[p.rsplit(b"/", 1)[0]] if b"/" in p else 0
        start, count = kids.get(p, (0, 0))
        for k, v in (("parent", parent), ("mode", (stat.S_IFDIR | 0o755) if is_dir else
                     (stat.S_IFREG | 0o644)), ("mtime_ns", 0), ("size", 0),
                     ("name_off", len(strings)), ("name_len", len(leaf)),
                     ("child_start", start), ("child_count", count), ("part", 0),
                     ("data_off", 0), ("stored_len", 0), ("crc", 0), ("codec", 0),
                     ("blocks", 0)):  # fmt: skip
            cols[k].append(v)
        strings += leaf
    columns = {k: np.array(v, dtype=dt) for (k, dt), v in
               zip(cat.ENTRY_COLUMNS, cols.values(), strict=True)}  # fmt: skip
    columns |= {"part_size": np.zeros(1, np.uint64), "part_files": np.zeros(1, np.uint64),
                "part_flags": np.zeros(1, np.uint32)}  # fmt: skip
    return cat.Catalog.from_bytes(cat.encode(columns, bytes(strings), {}))


NAME = st.binary(min_size=1, max_size=12).filter(lambda b: b"/" not in b and b"\0" not in b
                                                 and b not in (b".", b".."))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(NAME, min_size=1, max_size=3), min_size=1, max_size=40),
       st.lists(st.lists(NAME, min_size=1, max_size=3), max_size=20))  # fmt: skip
def test_resolving_many_paths_agrees_with_one_at_a_time(
    files: list[list[bytes]], others: list[list[bytes]]
) -> None:
    names = [b"/".join(f) for f in files]
    dirs = {b"/".join(f[:k]) for f in files for k in range(1, len(f))}
    names = [n for n in names if n not in dirs]  # a name is a file or a directory, not both
    if not names:
        return
    c = tree_catalog(names)
    asked = names + [b"/".join(o) for o in others] + [b"", b"/", b"//" + names[0],
                                                       names[0] + b"/"]  # fmt: skip
    random.Random(0).shuffle(asked)
    expected = [c.resolve(a) for a in asked]
    got = paths.resolve_many(c, asked).tolist()
    assert got == [-1 if e is None else e for e in expected]


def test_the_longest_path_bounds_a_plan() -> None:
    c = tree_catalog([b"a/bb/ccc", b"a/d", b"eeee"])
    assert plansocket.longest_path(c) == len(b"a/bb/ccc")


@pytest.mark.parametrize("n", [0, 5])
def test_a_plan_is_resolved_to_files_only(n: int) -> None:
    c = tree_catalog([b"x/f1", b"x/f2", b"y"])
    body = b"\0".join([b"x/f1", b"x", b"nope", b"y", b"x/f1"][:n]) + b"\0"
    order, missing, first = plansocket._resolve(c, body, n, 1 << 20, 16 << 20)
    assert len(order) == {0: 0, 5: 3}[n] and missing == {0: 0, 5: 2}[n]
    assert first == (None if n == 0 else "x")
