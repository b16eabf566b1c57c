"""Catalogs taken apart and put back together, for tests that craft hostile images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.image import catalog as cat


def columns_of(raw: bytes) -> tuple[dict[str, np.ndarray], bytes, dict[str, Any], int]:
    """(writable columns, strings, meta, frame size) of a serialised catalog."""
    fields = cat.HEADER.unpack_from(raw)
    version, n_entries, n_partitions = fields[1], fields[3], fields[4]
    strings_len, meta_len, n_dicts, frame_size = fields[6], fields[7], fields[10], fields[11]
    body = raw[cat.HEADER.size :]
    layout = cat._body_layout(n_entries, n_partitions, n_dicts, version)
    columns = {
        name: np.frombuffer(body, dtype=dtype, count=count, offset=off).copy()
        for name, dtype, off, count in layout[:-1]
    }
    at = layout[-1][2]
    strings = body[at : at + strings_len]
    meta = json.loads(body[at + strings_len : at + strings_len + meta_len])
    return columns, strings, meta, frame_size


def encode(columns: dict[str, np.ndarray], strings: bytes, meta: dict[str, Any],
           frame_size: int) -> bytes:  # fmt: skip
    """A catalog with valid checksums around whatever the columns say."""
    return cat.encode(columns, strings, meta, frame_size=frame_size)


def rewrite(image: Path, change: Any) -> None:
    """Apply `change(columns, strings) -> strings or None` to IMAGE's catalog, in place."""
    path = image / cat.CATALOG_NAME
    columns, strings, meta, frame_size = columns_of(path.read_bytes())
    new = change(columns, strings)
    path.write_bytes(encode(columns, strings if new is None else new, meta, frame_size))


def as_version_2(image: Path) -> None:
    """Rewrite IMAGE's catalog as fanfs wrote it before `blocks` (format 2), in place."""
    path = image / cat.CATALOG_NAME
    columns, strings, meta, frame_size = columns_of(path.read_bytes())
    path.write_bytes(cat.encode(columns, strings, meta, frame_size=frame_size, version=2))


def flip_stored_byte(
    image: Path, rel: bytes, at: int | None = None, mask: int = 0xFF
) -> tuple[cat.Catalog, int]:
    """Flip bits (`mask`) of one stored byte of file `rel` in IMAGE's partition, `at` bytes into
    its stored bytes (default: the middle), the catalog left as it was, so that only the CRC
    can tell. (The catalog, the file's entry.)"""
    c, _ = cat.Catalog.load(image)
    entry = c.resolve(rel)
    assert entry is not None, rel
    where = int(c.stored_len[entry]) // 2 if at is None else at
    part = image / cat.partition_name(int(c.part[entry]))
    data = bytearray(part.read_bytes())
    data[int(c.data_off[entry]) + where] ^= mask
    part.write_bytes(bytes(data))
    return c, entry
