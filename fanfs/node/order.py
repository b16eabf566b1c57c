"""One plan, indexed off the event loop: what `Plans` (fanfs/node/plans.py) needs to follow a
job through it, and what each position costs the budget.

`ShareOrder.build` sorts a plan of a million entries (a worker thread's job); `read_ahead_bytes`
says what the read-ahead engine reads of each file; `default_budget` is `--prefetch-mb`'s
default. Pure functions and an immutable record: any thread may use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fanfs.image import catalog as cat

# A framed file is read ahead up to this share of the budget (its first frames): one huge
# file must not take the whole budget, and the job's own READs fetch the rest in order.
PARTIAL_SHARE = 8


def default_budget() -> int:
    """A tenth of the memory available now, between 64 MiB and 4 GiB."""
    avail = 1 << 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(64 << 20, min(4 << 30, avail // 10))


def read_ahead_bytes(catalog: cat.Catalog, entries: np.ndarray, budget: int,
                     whole_limit: int) -> np.ndarray:  # fmt: skip
    """Decoded bytes the planner reads ahead for each of `entries`: a whole file's size (raw
    ones up to `whole_limit`, which are checked whole), a framed file's first frames up to
    budget / PARTIAL_SHARE (at least one frame); 0 for what it does not read ahead
    (directories, empty files, large raw files)."""
    size = catalog.size[entries].astype(np.int64)
    codec = catalog.codec[entries]
    files = catalog.is_file[entries] & (size > 0)
    raw_large = (codec == cat.CODEC_RAW) & (size > whole_limit)
    framed = codec == cat.CODEC_FRAMED
    partial = max(catalog.frame_size or 1, budget // PARTIAL_SHARE)
    cost = np.where(framed, np.minimum(size, partial), size)
    cost[~files | raw_large] = 0
    return np.asarray(cost, dtype=np.int64)


@dataclass
class ShareOrder:
    """One plan, indexed: what `Plans` needs to follow a job through it."""

    order: np.ndarray  # entries in the job's order (int64)
    cost: np.ndarray  # decoded bytes read ahead at each position (0 at repeats)
    ends: np.ndarray  # ends[i] = cost[: i + 1].sum()
    by_entry: np.ndarray  # positions sorted by entry, stable (so each entry's ascending)
    sorted_entries: np.ndarray  # order[by_entry]
    unique: np.ndarray  # distinct entries

    @classmethod
    def build(cls, order: np.ndarray, cost: np.ndarray) -> ShareOrder:
        order = np.ascontiguousarray(order, dtype=np.int64)
        by_entry = np.argsort(order, kind="stable")
        sorted_entries = order[by_entry]
        starts = np.flatnonzero(np.r_[True, sorted_entries[1:] != sorted_entries[:-1]]
                                if len(order) else [])  # fmt: skip
        first = np.zeros(len(order), dtype=bool)
        first[by_entry[starts]] = True  # each entry's first position: the only one read ahead
        cost = np.where(first, cost, 0).astype(np.int64)
        return cls(order, cost, np.cumsum(cost), by_entry, sorted_entries,
                   sorted_entries[starts])  # fmt: skip

    def __len__(self) -> int:
        return len(self.order)

    def upto(self, i: int) -> int:
        """Bytes read ahead for positions [0, i)."""
        return int(self.ends[i - 1]) if i > 0 else 0

    def occurrence(self, entry: int, at_least: int) -> int | None:
        """The first position of `entry` at or after `at_least`, or None."""
        lo = int(np.searchsorted(self.sorted_entries, entry, "left"))
        hi = int(np.searchsorted(self.sorted_entries, entry, "right"))
        if lo == hi:
            return None
        positions = self.by_entry[lo:hi]
        k = int(np.searchsorted(positions, at_least, "left"))
        return int(positions[k]) if k < len(positions) else None
