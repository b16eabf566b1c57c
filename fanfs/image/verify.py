"""Offline views of a prepared image: `fanfs info` (what is in it), `fanfs verify` (is it intact).

Both read only the image; neither mounts anything. `verify` is the second oracle of the tests:
it recomputes every file's checksum (and decodes compressed files) from the partition files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fanfs import placement
from fanfs.errors import CorruptFile
from fanfs.image import catalog as cat
from fanfs.image import codec
from fanfs.node.store import check_partitions, pread_exact
from fanfs.progress import Progress, human_bytes

log = logging.getLogger(__name__)

EXTENSION_ROWS = 12  # `info` lists the extensions holding the most bytes, then "other"


def by_extension(c: cat.Catalog) -> list[dict[str, Any]]:
    """Files, bytes, stored bytes and ratio per extension, most bytes first."""
    files = np.flatnonzero(c.is_file)
    exts = [os.fsdecode(cat.extension(c.name(int(e)))) or "(none)" for e in files]
    keys, index = np.unique(np.array(exts, dtype=object), return_inverse=True)
    count = np.bincount(index, minlength=len(keys))
    size = np.bincount(index, weights=c.size[files], minlength=len(keys))
    stored = np.bincount(index, weights=c.stored_len[files], minlength=len(keys))
    rows = sorted(zip(keys, count, size, stored, strict=True), key=lambda r: (-r[2], r[0]))
    if len(rows) > EXTENSION_ROWS:
        rest = rows[EXTENSION_ROWS - 1 :]
        other = ("(other)", *(sum(r[i] for r in rest) for i in (1, 2, 3)))
        rows = [*rows[: EXTENSION_ROWS - 1], other]
    return [
        {"extension": str(k), "files": int(n), "bytes": int(b), "bytes_stored": int(s),
         "ratio": round(b / s, 3) if s else 1.0}
        for k, n, b, s in rows
    ]  # fmt: skip


def nodes_needed(
    part_size: np.ndarray, part_flags: np.ndarray, capacity: int, replicas: int = 1
) -> int | None:
    """Fewest nodes whose local disks of `capacity` bytes hold every partition this daemon's
    placement would give them (None: no node count can, e.g. one partition is too big)."""
    sizes = np.asarray(part_size, dtype=np.int64)
    bcast = (np.asarray(part_flags) & cat.PART_BROADCAST) != 0
    normal = sizes[~bcast]
    if int(sizes[bcast].sum()) + (int(normal.max()) if len(normal) else 0) > capacity:
        return None
    n = max(1, -(-int(normal.sum()) * replicas // max(1, capacity - int(sizes[bcast].sum()))))
    while True:
        owners = placement.place(sizes, part_flags, n, replicas)
        if max(placement.rank_bytes(owners, sizes, n)) <= capacity:
            return n
        if n >= max(1, len(normal)) * replicas:
            return None
        n += 1


def info(image: Path, local_capacity: int | None = None, replicas: int = 1) -> dict[str, Any]:
    """What is in IMAGE; an image that could not be mounted (a partition missing or of the
    wrong size) is an error, as `mount` would find."""

    c, raw = cat.Catalog.load(image)
    check_partitions(image, c, range(c.n_partitions))
    files = c.is_file
    links = c.is_link
    bytes_in = int(c.size[files].sum())
    stored = int(c.stored_len[files].sum())
    sizes = c.part_size.astype(np.int64)
    codecs = {name: int((c.codec[files] == cid).sum()) for cid, name in cat.CODEC_NAMES.items()}
    out: dict[str, Any] = {
        "image": str(image),
        "format_version": c.version,
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
        "dictionaries": len(c.dicts),
        "dictionary_bytes": sum(len(d) for d in c.dicts),
        "frame_size": c.frame_size,
        "by_extension": by_extension(c),
        "partitions": c.n_partitions,
        "partition_bytes_min": int(sizes.min()) if len(sizes) else 0,
        "partition_bytes_max": int(sizes.max()) if len(sizes) else 0,
        "partition_bytes_mean": int(sizes.mean()) if len(sizes) else 0,
        "catalog_bytes": len(raw),
        "catalog_memory_bytes": c.memory_bytes(),
    }
    if local_capacity is not None:
        # Raw: the same partitions holding their files' decoded bytes.
        raw_sizes = np.bincount(
            c.part[files], weights=c.size[files], minlength=c.n_partitions
        ).astype(np.int64)
        out["capacity"] = {
            "local_capacity": local_capacity,
            "replicas": replicas,
            "nodes": nodes_needed(c.part_size, c.part_flags, local_capacity, replicas),
            "nodes_uncompressed": nodes_needed(raw_sizes, c.part_flags, local_capacity, replicas),
        }
    return out


def format_info(d: dict[str, Any]) -> str:
    lines = [
        f"image:       {d['image']} (format version {d['format_version']})",
        f"created:     {d['created']} from {d['source']} (compress {d['compress']})",
        f"entries:     {d['files']} files, {d['directories']} directories, "
        f"{d['symlinks']} symlinks",
        f"data:        {human_bytes(d['bytes'])} in, {human_bytes(d['bytes_stored'])} stored "
        f"(ratio {d['ratio']:.2f})",
        "codecs:      "
        + ", ".join(f"{k} {v}" for k, v in d["codecs"].items())
        + f"; {d['dictionaries']} dictionaries ({human_bytes(d['dictionary_bytes'])})",
        f"partitions:  {d['partitions']}, {human_bytes(d['partition_bytes_min'])} to "
        f"{human_bytes(d['partition_bytes_max'])} (mean {human_bytes(d['partition_bytes_mean'])})",
        f"catalog:     {human_bytes(d['catalog_bytes'])} on disk, "
        f"{human_bytes(d['catalog_memory_bytes'])} in memory",
        "by extension:",
    ]
    for row in d["by_extension"]:
        lines.append(
            f"  {row['extension']:<12} {row['files']:>10} files {human_bytes(row['bytes']):>10} "
            f"-> {human_bytes(row['bytes_stored']):>10} (ratio {row['ratio']:.2f})"
        )
    cap = d.get("capacity")
    if cap is not None:

        def nodes(n: int | None) -> str:
            return (
                str(n) if n is not None else "none fit (a partition is too big; more --partitions)"
            )

        lines.append(
            f"nodes with {human_bytes(cap['local_capacity'])} local disk each "
            f"(replicas {cap['replicas']}): {nodes(cap['nodes'])} as prepared, "
            f"{nodes(cap['nodes_uncompressed'])} uncompressed"
        )
    return "\n".join(lines)


def _pread(fd: int, n: int, off: int, end: int) -> bytes:
    """Exactly `n` bytes at `off`; CorruptFile (never a huge allocation) past `end`, the
    partition's real size, or on a read error."""
    if off > end or n > end - off:
        raise CorruptFile(f"its bytes lie past the partition's end ({end} bytes)")
    try:
        return pread_exact(fd, n, off, "the partition")
    except OSError as e:  # truncated, or a disk error: this file's problem line
        raise CorruptFile(e.strerror or str(e)) from None


def _check(fd: int, c: cat.Catalog, e: int, end: int) -> None:
    n, start = int(c.stored_len[e]), int(c.data_off[e])
    size = int(c.size[e])
    if c.codec[e] == cat.CODEC_FRAMED:
        t_off, t_len = codec.FrameTable.span(size, n, c.frame_size)
        table = codec.FrameTable(_pread(fd, t_len, start + t_off, end), size, n, c.frame_size,
                                 int(c.crc[e]))  # fmt: skip
        for i in range(len(table)):
            off, length = table.stored(i)
            table.decode(i, _pread(fd, length, start + off, end))
        return
    if c.codec[e] == cat.CODEC_RAW and n > codec.STREAM_CRC_CHUNK:
        crc = codec.streamed_crc(lambda off, k: _pread(fd, k, off, end), start, n)
        if crc != int(c.crc[e]):
            raise CorruptFile("checksum mismatch")
        return
    codec.decode(_pread(fd, n, start, end), int(c.codec[e]), size, int(c.crc[e]), c.dicts)


def verify(image: Path) -> Iterator[str]:
    """Yield one line per problem: a missing/short partition, or a file that fails its check
    (whatever the catalog claims: every file's problem is a line naming it, never a crash)."""
    c, _ = cat.Catalog.load(image)
    total = int(c.stored_len[c.is_file].sum())
    progress = Progress("verify", int(c.is_file.sum()), total)
    for p in range(c.n_partitions):
        entries = c.files_in_partition(p)
        path = image / cat.partition_name(p)
        try:
            fd = cat.open_regular(path)
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
                    _check(fd, c, i, size)
                except CorruptFile as err:
                    yield f"{os.fsdecode(c.path(i))}: {err} (partition {p})"
                except (MemoryError, OverflowError, ValueError) as err:
                    yield f"{os.fsdecode(c.path(i))}: impossible sizes ({type(err).__name__}) " \
                        f"(partition {p})"  # fmt: skip
                progress.update(1, int(c.stored_len[i]))
        finally:
            os.close(fd)
    progress.close()
