"""Recent latencies in a fixed ring buffer, for the percentiles `fanfs status` reports."""

from __future__ import annotations

import numpy as np

from fanfs.status import Percentiles

SAMPLES = 4096  # the most recent this many are kept


class Latencies:
    def __init__(self, samples: int = SAMPLES):
        self._ring = np.zeros(samples, dtype=np.float64)
        self.count = 0  # all ever recorded

    def record(self, seconds: float) -> None:
        self._ring[self.count % len(self._ring)] = seconds
        self.count += 1

    def percentiles_ms(self) -> Percentiles:
        """p50, p90 and p99 in milliseconds over the kept samples."""
        n = min(self.count, len(self._ring))
        pct = np.percentile(self._ring[:n], [50, 90, 99]) * 1e3 if n else [0.0] * 3
        return Percentiles(*(round(float(v), 3) for v in pct))
