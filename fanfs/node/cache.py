"""Bounded memory and shared work for the read path: a byte-bounded LRU, single-flight fetches
and a fixed ring of recent latencies.

`ByteLRU` keeps decoded bytes (whole files, frames of framed files) up to a byte budget, each
entry charged ENTRY_OVERHEAD beyond its data. `SingleFlight` makes one task do the work for a
key however many ask at once; the others wait, then look again. `Latencies` keeps the most
recent SAMPLES fetch times for the percentiles `fanfs status` reports.

Concurrency: `ByteLRU` and `SingleFlight` in the trio thread only (between two awaits the code
is atomic with respect to other tasks: trio is cooperative, which keeps them consistent
without locks); `Latencies` from any thread, under its owner's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import numpy as np
import trio

from fanfs.status import Percentiles

ENTRY_OVERHEAD = 120  # bytes a cache entry costs beyond its data (dict slot, bytes header)


class ByteLRU:
    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self.size = 0  # bytes charged, overhead included
        self.hits = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def peek(self, key: Hashable) -> bytes | None:
        """The bytes of `key` without counting a hit or refreshing it."""
        return self._items.get(key)

    def get(self, key: Hashable) -> bytes | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
            self.hits += 1
        return data

    def drop(self, key: Hashable) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= len(old) + ENTRY_OVERHEAD

    def clear(self) -> None:
        self._items.clear()
        self.size = 0

    def put(self, key: Hashable, data: bytes) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= len(old) + ENTRY_OVERHEAD
        self._items[key] = data
        self.size += len(data) + ENTRY_OVERHEAD
        # Evict least recently used, but keep the newest entry even if it alone is too big:
        # the request that fetched it must still be answered.
        while self.size > self.limit and len(self._items) > 1:
            _, gone = self._items.popitem(last=False)
            self.size -= len(gone) + ENTRY_OVERHEAD


class SingleFlight:
    def __init__(self) -> None:
        self._inflight: dict[Hashable, trio.Event] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._inflight

    def waiters(self, key: Hashable) -> int:
        """Tasks waiting for the fetch of `key` now under way (0 if none is)."""
        event = self._inflight.get(key)
        return 0 if event is None else event.statistics().tasks_waiting

    async def run(
        self, key: Hashable, lookup: Callable[[], Any], produce: Callable[[], Awaitable[Any]]
    ) -> Any:
        """`lookup()` if it has the answer, else `produce()`, run by one task however many ask
        at once. `lookup` may raise to stop the waiters (e.g. the file went bad meanwhile)."""
        while True:
            found = lookup()
            if found is not None:
                return found
            event = self._inflight.get(key)
            if event is None:
                break
            await event.wait()
        self._inflight[key] = trio.Event()
        try:
            return await produce()
        finally:
            self._inflight.pop(key).set()


SAMPLES = 4096  # the most recent this many are kept


class Latencies:
    def __init__(self, samples: int = SAMPLES):
        self._ring = np.zeros(samples, dtype=np.float64)
        self.count = 0  # all ever recorded
        self.longest = 0.0

    def record(self, seconds: float) -> None:
        self._ring[self.count % len(self._ring)] = seconds
        self.count += 1
        self.longest = max(self.longest, seconds)

    def percentiles_ms(self) -> Percentiles:
        """p50, p90 and p99 in milliseconds over the kept samples, and the longest ever."""
        return percentiles_ms(self._ring[: min(self.count, len(self._ring))], self.longest)


def percentiles_ms(seconds: np.ndarray, longest: float) -> Percentiles:
    """p50, p90, p99 of `seconds` and `longest`, in milliseconds."""
    pct = np.percentile(seconds, [50, 90, 99]) * 1e3 if len(seconds) else [0.0] * 3
    p50, p90, p99 = (round(float(v), 3) for v in pct)
    return Percentiles(p50, p90, p99, round(longest * 1e3, 3))
