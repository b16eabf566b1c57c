"""`fanfs bench --data`: what the benchmark's files hold.

- random: incompressible bytes of one size per `--sizes` entry (fanfs stores them raw);
- arrays: 1 MiB float32 arrays, half of them prices (a random walk rounded to two decimals:
  fanfs's decimal4 filter), half smooth fields like a simulation's output (delta4);
- text: CSV tables of sensor readings, 20 to 150 KiB;
- jpeg: photo-like JPEG images of 500x375 pixels (about ImageNet's mean size), which a PyTorch
  DataLoader decodes in `--client torch`.

Deterministic for a given seed. Each kind yields `total` bytes (at least `min_files` files),
16 directories of them, named as relative paths.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fanfs.bench import datagen

KINDS = ("random", "arrays", "text", "jpeg")
# Kinds whose files fanfs compresses (`--compress auto`): measured also against the same files
# stored raw, and against a compressed squashfs image.
COMPRESSIBLE = ("arrays", "text")


def _prices(rng: np.random.Generator) -> bytes:
    n = (1 << 20) // 4
    walk = 100 + np.cumsum(rng.normal(0, 0.05, n))
    return np.round(walk, 2).astype(np.float32).tobytes()


def _field(rng: np.random.Generator) -> bytes:
    return datagen.smooth_field(rng, 512, 512).tobytes()


def _csv(rng: np.random.Generator) -> bytes:
    return datagen.csv_table(rng, int(rng.integers(400, 3000)))


def _jpeg(rng: np.random.Generator) -> bytes:
    """Smooth colour fields plus sensor noise, 500x375, quality 90 (about 100 KiB)."""
    from PIL import Image

    rgb = np.stack([datagen.smooth_field(rng, 375, 500, 0.02) for _ in range(3)], axis=-1)
    rgb = (rgb - rgb.min()) / (np.ptp(rgb) or 1) * 230 + rng.normal(0, 6, rgb.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make(kind: str, root: Path, size: int, total: int, min_files: int, seed: int) -> list[str]:
    """Write a dataset of `kind` under `root`; its files' paths relative to `root`."""
    rng = np.random.default_rng(seed)
    make_one: Callable[[int], bytes]
    if kind == "random":
        make_one = lambda i: rng.bytes(size)  # noqa: E731
    elif kind == "arrays":
        make_one = lambda i: (_prices if i % 2 else _field)(rng)  # noqa: E731
    elif kind == "text":
        make_one = lambda i: _csv(rng)  # noqa: E731
    elif kind == "jpeg":
        make_one = lambda i: _jpeg(rng)  # noqa: E731
    else:
        raise ValueError(f"unknown data kind {kind!r} (one of {', '.join(KINDS)})")
    rels: list[str] = []
    written = 0
    suffix = {"random": "bin", "arrays": "f32", "text": "csv", "jpeg": "jpg"}[kind]
    while written < total or len(rels) < min_files:
        i = len(rels)
        rel = f"d{i % 16:02d}/f{i:06d}.{suffix}"
        data = make_one(i)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        rels.append(rel)
        written += len(data)
    return rels
