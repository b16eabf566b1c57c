"""A PyTorch DataLoader over fanfs with and without a plan, against the same files on disk.

    .venv/bin/python tools/torch_plan_bench.py [--files 3000] [--repeat 3]

Generates an image folder of JPEGs (about 110 KiB each, as ImageNet's), prepares and mounts
it (one daemon), then, cold (kernel caches dropped: run as root), reads one epoch with a
DataLoader (4 workers, batch 32, Pillow decode and a resize per sample, a seeded shuffle)
three ways: from the source directory (native), from the mount (fanfs), and from the mount
with `fanfs.torch.PlannedSampler` (fanfs planned). Each loader lists its folder first, as
torchvision's ImageFolder does. Reports samples/s per way and the ratios to native, checks
that every way yields the same samples in the same order, and prints the planner's status.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from fanfs.bench import drop_caches
from fanfs.bench.launch import check, mounted
from fanfs.torch import PlannedSampler

SIDE = 64


class Folder(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, root: Path):
        self.root = root
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [(f"{c}/{f}", k) for k, c in enumerate(classes)
                        for f in sorted(os.listdir(root / c))]  # fmt: skip

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        rel, _ = self.samples[i]
        with Image.open(self.root / rel) as im:
            pixels = np.asarray(im.convert("RGB").resize((SIDE, SIDE)), dtype=np.uint8)
        return torch.from_numpy(pixels.copy()), rel


def make(src: Path, n: int) -> None:
    rng = np.random.default_rng(1)
    for i in range(n):
        d = src / f"class{i % 20:02d}"
        d.mkdir(parents=True, exist_ok=True)
        noise = rng.integers(0, 255, (280, 330, 3), dtype=np.uint8)  # about 110 KiB as JPEG
        Image.fromarray(noise).save(d / f"img{i:05d}.jpg", quality=90)


def epoch(root: Path, mnt: Path | None, seed: int) -> tuple[float, str]:
    """(samples/s, digest of the sample order) of one epoch from `root`; `mnt`: plan it."""
    data = Folder(root)
    gen = torch.Generator().manual_seed(seed)
    sampler: Any = torch.utils.data.RandomSampler(data, generator=gen)
    if mnt is not None:
        sampler = PlannedSampler(sampler, [root / rel for rel, _ in data.samples], mnt)
    loader = torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler, num_workers=4)
    digest = hashlib.sha256()
    began = time.perf_counter()
    n = 0
    for x, rels in loader:
        n += len(x)
        digest.update("\n".join(rels).encode())
    return n / (time.perf_counter() - began), digest.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fanfs-torch-plan-"))
    try:
        make(work / "src", args.files)
        check("-q", "prepare", work / "src", work / "img", timeout=600)
        results: dict[str, list[float]] = {"native": [], "fanfs": [], "fanfs planned": []}
        with mounted(work / "img", work / "mnt", work / "local") as d:
            d.wait_staged()
            mnt = d.mountpoint
            for i in range(args.repeat):
                digests = set()
                for way, root, plan in (("native", work / "src", None), ("fanfs", mnt, None),
                                        ("fanfs planned", mnt, mnt)):  # fmt: skip
                    if not drop_caches():
                        print("not root: cannot drop the caches, nothing is cold", file=sys.stderr)
                        return 1
                    rate, digest = epoch(root, plan, seed=i)
                    results[way].append(rate)
                    digests.add(digest)
                    print(f"  {i}: {way}: {rate:.0f} samples/s", file=sys.stderr)
                assert len(digests) == 1, "the three ways yielded different samples"
            print(f"plan: {d.status()['plan']}", file=sys.stderr)
        native = statistics.median(results["native"])
        print(f"DataLoader, 4 workers, {args.files} JPEGs, cold, median of {args.repeat}:")
        for way, rates in results.items():
            med = statistics.median(rates)
            print(f"  {way:14} {med:7.0f} samples/s  {med / native:.2f} of native "
                  f"(min {min(rates):.0f}, max {max(rates):.0f})")  # fmt: skip
        print("  every way yielded the same samples in the same order")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
