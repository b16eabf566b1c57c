"""Content keys of partitions, for the copies kept between jobs (fanfs/node/keep.py): the same
for the same bytes, whatever the image is called, and different once a byte changes."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from fanfs.image import catalog as cat

# Two kinds of key, never equal: from the catalog's SHA-256 of the partition (images of format
# 4 on), else from its files' CRCs (older images). Each changes when what it covers changes.
KEY_SHA = b"fanfs-keep sha256 1\0"
KEY_VERSION = b"fanfs-keep 1\0"


def partition_keys(catalog: cat.Catalog, parts: Sequence[int]) -> dict[int, str]:
    """The content key of each partition in `parts`, so that an unchanged partition of a
    re-prepared image has the same key and a changed file changes its partition's: from the
    SHA-256 of the partition's bytes that the catalog records (format 4), else from its size
    and the offset, stored length and CRC-32 of every file in it, in on-disk order (prepare
    packs a partition's files back to back, so these describe every byte of it, but a changed
    file of the same length and CRC-32 would keep the key)."""
    c = catalog
    digests = {p: partition_digest(c, p) for p in parts}
    if all(digests.values()):
        return {p: key_of_digest(int(c.part_size[p]), digests[p]) for p in parts}
    files = np.flatnonzero(c.is_file & (c.part != cat.NO_PARTITION))
    files = files[np.lexsort((c.data_off[files], c.part[files]))]
    in_part = c.part[files]
    keys = {}
    for p in parts:
        lo, hi = np.searchsorted(in_part, [p, p + 1])
        ids = files[lo:hi]
        h = hashlib.sha256(KEY_VERSION)
        h.update(struct.pack("<QQ", int(c.part_size[p]), len(ids)))
        for column, dtype in ((c.data_off, "<u8"), (c.stored_len, "<u8"), (c.crc, "<u4")):
            h.update(np.ascontiguousarray(column[ids], dtype=dtype).tobytes())
        keys[p] = h.hexdigest()
    return keys


def partition_digest(catalog: cat.Catalog, part: int) -> bytes:
    """The partition's SHA-256 from the catalog; b"" for images older than format 4 (or a
    catalog that left it zero)."""
    if catalog.part_sha256 is None:
        return b""
    digest: bytes = catalog.part_sha256[part].tobytes()
    return b"" if digest == bytes(32) else digest


def key_of_digest(size: int, digest: bytes) -> str:
    return hashlib.sha256(KEY_SHA + struct.pack("<Q", size) + digest).hexdigest()
