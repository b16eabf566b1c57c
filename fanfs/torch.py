"""PyTorch: `PlannedSampler`, a sampler that tells fanfs each epoch's order (planned epochs).

    sampler = DistributedSampler(dataset, shuffle=True)        # or any sampler
    sampler = fanfs.torch.PlannedSampler(sampler, paths, "/mnt/data")
    loader = DataLoader(dataset, sampler=sampler, num_workers=4, ...)

`paths[i]` is the file sample i is read from (under the mount, relative or absolute). Each
`__iter__` draws the wrapped sampler's indices for the epoch, publishes the files in that order
to the daemon (`fanfs.plan`), then yields exactly those indices, so training sees the samples
it sees without fanfs; `set_epoch` and `len` pass through. As it yields it tells the daemon how
far the epoch has gone (every PROGRESS_EVERY samples), which lets the daemon read further
ahead when the job's reads are answered from the page cache and never reach it. Each training
rank on a node publishes its own share (by default the wrapped sampler's `rank`, else 0). If the
daemon cannot be reached, training goes on unplanned (a warning, once).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from fanfs import plan
from fanfs.errors import FanfsError

log = logging.getLogger(__name__)

PROGRESS_EVERY = 64


class PlannedSampler:
    def __init__(
        self,
        sampler: Any,
        paths: Sequence[str | os.PathLike[str]],
        mountpoint: str | os.PathLike[str],
        share: int | None = None,
    ):
        self.sampler = sampler
        self.paths = paths
        self.mountpoint = mountpoint
        self.share = int(getattr(sampler, "rank", 0)) if share is None else share
        self._channel: plan.Channel | None = None
        self._warned = False

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices = [int(i) for i in self.sampler]
        planned = self._call(lambda ch: ch.publish([self.paths[i] for i in indices], self.share))
        for k, i in enumerate(indices):
            if planned and k and k % PROGRESS_EVERY == 0:
                planned = self._call(lambda ch, k=k: ch.progress(k, self.share))
            yield i

    def _call(self, fn: Any) -> bool:
        try:
            if self._channel is None:
                self._channel = plan.Channel(self.mountpoint)
            fn(self._channel)
            return True
        except FanfsError as e:
            if not self._warned:
                self._warned = True
                log.warning("fanfs: reading without a plan: %s", e)
            self._channel = None
            return False
