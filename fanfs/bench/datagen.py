"""Generated datasets: the demo's sample, and the awkward tree the tests read back byte for byte.

Deterministic for a given seed, so a failing test can be reproduced exactly.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

KIB = 1 << 10
MIB = 1 << 20


def _content(rng: np.random.Generator, size: int, compressible: float) -> bytes:
    """`size` bytes of which about `compressible` is repetitive text, the rest random."""
    n_text = int(size * compressible)
    words = b"epoch loss accuracy batch tensor gradient sample label image "
    text = (words * (n_text // len(words) + 1))[:n_text]
    return text + rng.bytes(size - n_text)


def csv_table(rng: np.random.Generator, rows: int) -> bytes:
    """A small CSV file of sensor-like readings, as in tabular and time-series datasets."""
    lines = ["step,time,temperature,pressure,label"]
    for i in range(rows):
        t, p = 280 + rng.normal() * 3, 1013 + rng.normal() * 5
        lines.append(f"{i},{1700000000 + 60 * i},{t:.3f},{p:.2f},{rng.choice(['ok', 'warn'])}")
    return ("\n".join(lines) + "\n").encode()


def smooth_field(rng: np.random.Generator, ny: int, nx: int, scale: float = 0.01) -> np.ndarray:
    """A smooth float32 field like a simulation's output (a temperature map): Gaussian noise
    low-pass filtered to a correlation length of about 1/scale grid points."""
    k2 = np.fft.fftfreq(ny)[:, None] ** 2 + np.fft.rfftfreq(nx)[None, :] ** 2
    spectrum = np.fft.rfft2(rng.standard_normal((ny, nx))) * np.exp(-k2 / (2 * scale**2))
    f = np.fft.irfft2(spectrum, s=(ny, nx))
    return (280 + 10 * f / (f.std() or 1)).astype(np.float32)


def sample(dest: Path, n_files: int = 2000, classes: int = 20, seed: int = 0) -> int:
    """An image-folder-like tree: `classes` directories of files from 4 KiB to 2 MiB.

    Sizes are log-uniform (many small, few large, as in image datasets); about half of each
    file is compressible. Returns the total bytes written.
    """
    rng = np.random.default_rng(seed)
    lo, hi = math.log(4 * KIB), math.log(2 * MIB)
    total = 0
    for i in range(n_files):
        d = dest / "train" / f"class{i % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        size = int(math.exp(rng.uniform(lo, hi)))
        (d / f"img{i:06d}.bin").write_bytes(_content(rng, size, 0.5))
        total += size
    return total


def awkward(dest: Path, big_bytes: int = 64 * MIB + 12345, seed: int = 1) -> None:
    """Every case that tends to break a file system's view of a tree."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = os.fsencode(dest)
    os.makedirs(root, exist_ok=True)

    def put(rel: bytes, data: bytes, mode: int = 0o644) -> None:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    put(b"non-utf8-\xff\xfe-caf\xe9.bin", rng.bytes(1000))
    put(b"L" * 255, b"longest name allowed\n")
    put(b"with spaces/a file name with spaces.txt", b"spaced out\n")
    deep = b"/".join(b"d%02d" % i for i in range(40))
    put(deep + b"/bottom.txt", b"deep down\n")
    put(b"empty-file", b"")
    os.makedirs(os.path.join(root, b"empty-dir"), exist_ok=True)
    os.makedirs(os.path.join(root, b"nested-empty/inner/innermost"), exist_ok=True)
    put(b"sizes/exact-4096.bin", rng.bytes(4096))
    put(b"sizes/exact-131072.bin", rng.bytes(131072))
    put(b"sizes/one-byte.bin", b"x")
    put(b"sizes/compressible-1m.txt", _content(rng, MIB, 1.0))
    put(b"sizes/mixed-300k.bin", _content(rng, 300 * KIB, 0.5))
    put(b"modes/secret", b"owner only\n", 0o600)
    put(b"modes/script.sh", b"#!/bin/sh\necho hi\n", 0o755)
    put(b"modes/readonly", b"r\n", 0o444)
    # Over 64 MiB, half compressible: big enough to take the chunked paths, raw and zstd.
    put(b"big/over-64mib.bin", _content(rng, big_bytes, 0.5))
    arrays = os.path.join(root, b"arrays")
    os.makedirs(arrays, exist_ok=True)
    np.save(os.fsdecode(os.path.join(arrays, b"field.npy")), rng.standard_normal((64, 64)))
    images = os.fsdecode(os.path.join(root, b"images"))
    os.makedirs(images, exist_ok=True)
    pixels = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(os.path.join(images, "noise.png"))
    Image.fromarray(pixels).save(os.path.join(images, "noise.jpg"), quality=90)
    # Compressible kinds that take the other codec paths: small CSV files (enough of them for
    # a dictionary), smooth float32 fields (delta4), one big enough to be framed.
    for i in range(80):
        put(b"tables/t%02d.csv" % i, csv_table(rng, int(rng.integers(5, 120))))
    put(b"fields/small.f32", smooth_field(rng, 64, 64).tobytes())
    put(b"fields/big.f32", smooth_field(rng, 1200, 1200).tobytes())  # 5.5 MiB
    # The other array filters: decimals stored as floats (decimal4, and framed decimal8),
    # small random integers (shuffle4, shuffle8), a smooth float64 field (delta8).
    walk = np.cumsum(rng.normal(0, 1, 40_000))
    put(b"fields/prices.f32", walk.round(2).astype(np.float32).tobytes())
    put(b"fields/walk.f64", np.cumsum(rng.normal(0, 1, 640_000)).round(3).tobytes())  # 4.9 MiB
    put(b"arrays/labels.i32", rng.integers(0, 1000, 30_000).astype(np.int32).tobytes())
    put(b"arrays/ids.i64", rng.integers(0, 100_000, 20_000).astype(np.int64).tobytes())  # shuffle8
    put(b"arrays/smooth.f64", np.cumsum(np.cumsum(rng.normal(0, 1, 20_000))).tobytes())  # delta8
    # 2 MiB of noise compressed whole to about 1.3 MiB: read in parts through the pool's cache.
    for name in (b"fields/noisy.f32", b"fields/noisy-b.f32"):
        put(name, rng.normal(280, 5, 512 << 10).astype(np.float32).tobytes())
    for i in range(200):  # many small files across a few directories
        put(b"many/c%d/f%03d.dat" % (i % 7, i), rng.bytes(int(rng.integers(0, 20000))))
    os.symlink(b"sizes/exact-4096.bin", os.path.join(root, b"link-to-file"))
    os.symlink(b"many", os.path.join(root, b"link-to-dir"))
    os.symlink(b"/nonexistent/target", os.path.join(root, b"dangling-absolute"))
    os.symlink(b"\xff-non-utf8-target", os.path.join(root, b"link-non-utf8"))
    # Distinct, sub-second mtimes, set last (children first so parents keep theirs).
    stamp = 1_600_000_000_123_456_789
    for dirpath, dirnames, filenames in sorted(os.walk(root), reverse=True):
        for name in filenames + dirnames:
            stamp += 1_000_001
            os.utime(os.path.join(dirpath, name), ns=(stamp, stamp), follow_symlinks=False)
