"""Offline views of a prepared image: `fanfs info` (what is in it), `fanfs verify` (is it intact).

Both read only the image; neither mounts anything. `verify` is the second oracle of the tests:
it recomputes every file's checksum (and decodes compressed files) from the partition files.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fanfs import catalog as cat
from fanfs import codec
from fanfs.errors import CorruptFile
from fanfs.progress import Progress, human_bytes

log = logging.getLogger(__name__)

VERIFY_CHUNK = 8 << 20  # big raw files are checked in chunks, never held whole


def info(image: Path) -> dict[str, Any]:
    c, raw = cat.Catalog.load(image)
    files = c.is_file
    links = c.is_link
    bytes_in = int(c.size[files].sum())
    stored = int(c.stored_len[files].sum())
    sizes = c.part_size.astype(np.int64)
    codecs = {name: int((c.codec[files] == cid).sum()) for cid, name in cat.CODEC_NAMES.items()}
    return {
        "image": str(image),
        "format_version": cat.VERSION,
        "created": c.meta.get("created"),
        "source": c.meta.get("source"),
        "compress": c.meta.get("compress"),
        "files": int(files.sum()),
        "directories": int(c.is_dir.sum()),
        "symlinks": int(links.sum()),
        "bytes": bytes_in,
        "bytes_stored": stored,
        "ratio": round(bytes_in / stored, 3) if stored else 1.0,
        "codecs": codecs,
        "partitions": c.n_partitions,
        "partition_bytes_min": int(sizes.min()) if len(sizes) else 0,
        "partition_bytes_max": int(sizes.max()) if len(sizes) else 0,
        "partition_bytes_mean": int(sizes.mean()) if len(sizes) else 0,
        "catalog_bytes": len(raw),
        "catalog_memory_bytes": c.memory_bytes(),
    }


def format_info(d: dict[str, Any]) -> str:
    lines = [
        f"image:       {d['image']} (format version {d['format_version']})",
        f"created:     {d['created']} from {d['source']} (compress {d['compress']})",
        f"entries:     {d['files']} files, {d['directories']} directories, "
        f"{d['symlinks']} symlinks",
        f"data:        {human_bytes(d['bytes'])} in, {human_bytes(d['bytes_stored'])} stored "
        f"(ratio {d['ratio']:.2f})",
        "codecs:      " + ", ".join(f"{k} {v}" for k, v in d["codecs"].items()),
        f"partitions:  {d['partitions']}, {human_bytes(d['partition_bytes_min'])} to "
        f"{human_bytes(d['partition_bytes_max'])} (mean {human_bytes(d['partition_bytes_mean'])})",
        f"catalog:     {human_bytes(d['catalog_bytes'])} on disk, "
        f"{human_bytes(d['catalog_memory_bytes'])} in memory",
    ]
    return "\n".join(lines)


def _check(fd: int, c: cat.Catalog, e: int) -> None:
    n, start = int(c.stored_len[e]), int(c.data_off[e])
    if c.codec[e] == cat.CODEC_RAW and n > VERIFY_CHUNK:
        crc = 0
        for off in range(0, n, VERIFY_CHUNK):
            chunk = os.pread(fd, min(VERIFY_CHUNK, n - off), start + off)
            if not chunk:
                raise CorruptFile("truncated")
            crc = zlib.crc32(chunk, crc)
        if crc != int(c.crc[e]):
            raise CorruptFile("checksum mismatch")
        return
    stored = os.pread(fd, n, start)
    if len(stored) != n:
        raise CorruptFile("truncated")
    codec.decode(stored, int(c.codec[e]), int(c.size[e]), int(c.crc[e]))


def verify(image: Path) -> Iterator[str]:
    """Yield one line per problem: a missing/short partition, or a file that fails its check."""
    c, _ = cat.Catalog.load(image)
    total = int(c.stored_len[c.is_file].sum())
    progress = Progress("verify", int(c.is_file.sum()), total)
    for p in range(c.n_partitions):
        entries = c.files_in_partition(p)
        path = image / cat.partition_name(p)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            yield f"{path}: partition missing ({e.strerror}); {len(entries)} files unreadable"
            continue
        try:
            size = os.fstat(fd).st_size
            if size != int(c.part_size[p]):
                yield f"{path}: partition is {size} bytes, expected {int(c.part_size[p])}"
            for entry in entries:
                i = int(entry)
                try:
                    _check(fd, c, i)
                except CorruptFile as err:
                    yield f"{os.fsdecode(c.path(i))}: {err} (partition {p})"
                progress.update(1, int(c.stored_len[i]))
        finally:
            os.close(fd)
    progress.close()
