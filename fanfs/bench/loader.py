"""`fanfs bench --client torch`: images read as a PyTorch training job reads them.

A `torch.utils.data.DataLoader` with `readers` worker processes (2 by default, as in most
single-GPU jobs), batches of 32, over the pass's files in its order: each worker opens a JPEG
with PIL, decodes it, takes the centre 224x224 crop and makes a uint8 tensor, as torchvision's
ImageFolder with CenterCrop and PILToTensor would. Each sample's CRC-32 comes back with it, so
the bench can say that fanfs and native reads gave identical samples. Needs torch and Pillow
(`pip install -e '.[test]'`).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

BATCH = 32
CROP = 224


class _Images:
    """A map-style dataset over paths (torch's Dataset protocol)."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        import numpy as np
        import torch
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            a = np.asarray(im.convert("RGB"))
        h, w = a.shape[:2]
        top, left = max(0, (h - CROP) // 2), max(0, (w - CROP) // 2)
        a = np.ascontiguousarray(a[top : top + CROP, left : left + CROP])
        return torch.from_numpy(a).permute(2, 0, 1), zlib.crc32(a.tobytes())


def read_loader(paths: Sequence[str], workers: int) -> tuple[float, int, list[float], list[int]]:
    """(wall seconds, decoded bytes, per-batch seconds per sample, each sample's CRC-32 in
    order) of one pass of a DataLoader over `paths`."""
    from torch.utils.data import DataLoader

    dataset: Any = _Images(paths)  # torch's Dataset protocol, not its class
    loader: Any = DataLoader(dataset, batch_size=BATCH, num_workers=workers, shuffle=False,
                             prefetch_factor=2 if workers else None)  # fmt: skip
    crcs: list[int] = []
    lat: list[float] = []
    nbytes = 0
    t0 = last = time.monotonic()
    for images, sums in loader:
        now = time.monotonic()
        lat += [(now - last) / len(sums)] * len(sums)
        last = now
        nbytes += int(images.numel())
        crcs += [int(s) for s in sums]
    wall = time.monotonic() - t0
    return wall, nbytes, lat, crcs
