"""The catalog: every entry of a prepared image, as compact numpy columns plus one string table.

Invariants (checked by `Catalog.from_bytes`, documented in docs/format.md):
- Entry 0 is the root directory; inode = entry index + 1 (FUSE's root inode is 1).
- A directory's children are contiguous (`child_start`, `child_count`) and sorted by name bytes,
  so readdir is a slice and lookup a binary search. Entries come in walk order: every entry's
  parent has a smaller id, the children ranges of all directories cover entries 1..n-1 once,
  and only directories have children (so the tree has no cycle and no hidden entry).
- Names are 1 to 255 bytes without `/` or NUL, never `.` or `..`, unique within a directory.
- Every entry is a directory, a regular file or a symlink. A raw file's stored length is its
  size; a file compressed whole is at most WHOLE_DECODE_MAX bytes decoded, and framed files use
  the one frame size prepare writes (FRAME_SIZE): what one decode may cost in memory is bounded
  by what prepare writes, not by what a hostile catalog claims.
- `blocks` (st_blocks of the source, 512-byte units) is at most BLOCKS_MAX, so that stat's users
  can turn it into bytes; a version-2 image has none and reads as the size rounded up.
- Regular files point into a partition (`part`, `data_off`, `stored_len`) that lies within the
  partition's recorded size; symlinks keep their target in the string table.
The catalog is immutable after load: it needs no locks and is shared by every task and thread.
Memory: 77 bytes per entry in the columns plus the names, no Python object per entry.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.errors import CorruptCatalog, ImageError, ImageVersionError
from fanfs.image import catalog_check
from fanfs.image.checksum import crc32
from fanfs.image.format import (
    _CHUNK as _CHUNK,
)
from fanfs.image.format import (
    _WORD as _WORD,
)
from fanfs.image.format import (  # the format's names, re-exported: cat.CODEC_RAW and the rest
    ALIGN as ALIGN,
)
from fanfs.image.format import (
    BLOCK_UNIT as BLOCK_UNIT,
)
from fanfs.image.format import (
    BLOCKS_MAX as BLOCKS_MAX,
)
from fanfs.image.format import (
    CATALOG_NAME as CATALOG_NAME,
)
from fanfs.image.format import (
    CODEC_FRAMED as CODEC_FRAMED,
)
from fanfs.image.format import (
    CODEC_NAMES as CODEC_NAMES,
)
from fanfs.image.format import (
    CODEC_RAW as CODEC_RAW,
)
from fanfs.image.format import (
    CODEC_ZSTD as CODEC_ZSTD,
)
from fanfs.image.format import (
    CODEC_ZSTD_DELTA4 as CODEC_ZSTD_DELTA4,
)
from fanfs.image.format import (
    CODEC_ZSTD_DICT as CODEC_ZSTD_DICT,
)
from fanfs.image.format import (
    CODEC_ZSTD_FILTERED as CODEC_ZSTD_FILTERED,
)
from fanfs.image.format import (
    DICT_COLUMNS as DICT_COLUMNS,
)
from fanfs.image.format import (
    ENTRY_COLUMNS as ENTRY_COLUMNS,
)
from fanfs.image.format import (
    FRAME_ENTRY as FRAME_ENTRY,
)
from fanfs.image.format import (
    FRAME_FILTER_SHIFT as FRAME_FILTER_SHIFT,
)
from fanfs.image.format import (
    FRAME_LEN_MASK as FRAME_LEN_MASK,
)
from fanfs.image.format import (
    FRAME_SIZE as FRAME_SIZE,
)
from fanfs.image.format import (
    HEADER as HEADER,
)
from fanfs.image.format import (
    MAGIC as MAGIC,
)
from fanfs.image.format import (
    NAME_MAX as NAME_MAX,
)
from fanfs.image.format import (
    NO_PARTITION as NO_PARTITION,
)
from fanfs.image.format import (
    PART_BROADCAST as PART_BROADCAST,
)
from fanfs.image.format import (
    PARTITION_COLUMNS as PARTITION_COLUMNS,
)
from fanfs.image.format import (
    READ_VERSIONS as READ_VERSIONS,
)
from fanfs.image.format import (
    S_IFMT as S_IFMT,
)
from fanfs.image.format import (
    VERSION as VERSION,
)
from fanfs.image.format import (
    WHOLE_DECODE_MAX as WHOLE_DECODE_MAX,
)
from fanfs.image.format import (
    _body_layout as _body_layout,
)
from fanfs.image.format import (
    _padded as _padded,
)
from fanfs.image.format import (
    blocks_of_size as blocks_of_size,
)
from fanfs.image.format import (
    n_frames as n_frames,
)
from fanfs.image.format import (
    partition_name as partition_name,
)


def extension(name: bytes) -> bytes:
    """A file name's extension, case folded (b".jpeg"), or b"" (dot files have none)."""
    dot = name.rfind(b".")
    return name[dot:].lower() if dot > 0 else b""


def open_regular(path: Path | str) -> int:
    """An fd of `path` for reading, if it is a regular file; OSError otherwise. Opened without
    blocking: a FIFO put in an image's place would block an open (and the daemon) for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Catalog:
    """A loaded, validated catalog. Read-only."""

    def __init__(
        self,
        columns: dict[str, np.ndarray],
        strings: bytes,
        meta: dict[str, Any],
        frame_size: int = 0,
        version: int = VERSION,
    ):
        self.version = version
        self.parent = columns["parent"]
        self.mode = columns["mode"]
        self.mtime_ns = columns["mtime_ns"]
        self.size = columns["size"]
        self.name_off = columns["name_off"]
        self.name_len = columns["name_len"]
        self.child_start = columns["child_start"]
        self.child_count = columns["child_count"]
        self.part = columns["part"]
        self.data_off = columns["data_off"]
        self.stored_len = columns["stored_len"]
        self.crc = columns["crc"]
        self.codec = columns["codec"]
        self.blocks = columns["blocks"]
        self.part_size = columns["part_size"]
        self.part_files = columns["part_files"]
        self.part_flags = columns["part_flags"]
        # SHA-256 of each partition file (version 4 on; None before): what a kept copy of a
        # partition is keyed by (fanfs/node/keep.py)
        self.part_sha256: np.ndarray | None = columns.get("part_sha256")
        self.strings = strings
        self.meta = meta
        self.frame_size = frame_size
        # zstd dictionary id i + 1 is dicts[i]; frames name their dictionary in their header.
        self.dicts = [
            strings[int(o) : int(o) + int(n)]
            for o, n in zip(columns["dict_off"], columns["dict_len"], strict=True)
        ]
        self.n_entries = len(self.parent)
        self.n_partitions = len(self.part_size)
        fmt = self.mode & S_IFMT
        self.is_dir = fmt == stat.S_IFDIR
        self.is_file = fmt == stat.S_IFREG
        self.is_link = fmt == stat.S_IFLNK
        # POSIX nlink of a directory: 2 + its subdirectories (find(1) relies on it).
        self.nlink = np.ones(self.n_entries, dtype=np.uint32)
        subdirs = np.bincount(self.parent[1:][self.is_dir[1:]], minlength=self.n_entries)
        self.nlink[self.is_dir] = 2 + subdirs[self.is_dir]

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, image: Path) -> tuple[Catalog, bytes]:
        """Read and validate IMAGE's catalog; return it with its raw bytes (for broadcast)."""
        path = image / CATALOG_NAME
        if not image.is_dir():
            what = "not a directory" if image.exists() else "no such directory"
            raise ImageError(f"{image}: not a fanfs image ({what})")
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            raise ImageError(f"{image}: not a fanfs image (no {CATALOG_NAME})") from None
        except OSError as e:
            raise ImageError(f"{path}: cannot read catalog: {e.strerror}") from None
        try:
            with open(fd, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ImageError(f"{path}: cannot read catalog: {e.strerror}") from None
        return cls.from_bytes(data, str(path)), data

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "catalog") -> Catalog:
        if len(data) < HEADER.size:
            raise CorruptCatalog(f"{where}: truncated catalog ({len(data)} bytes)")
        fields = HEADER.unpack_from(data)
        magic, version, header_crc, n_entries, n_partitions, _flags = fields[:6]
        strings_len, meta_len, body_len, body_sha, n_dicts, frame_size = fields[6:]
        if magic != MAGIC:
            raise CorruptCatalog(f"{where}: not a fanfs catalog (bad magic)")
        if version not in READ_VERSIONS:
            known = ", ".join(map(str, READ_VERSIONS[:-1])) + f" and {READ_VERSIONS[-1]}"
            hint = " (prepare the image again)" if version < min(READ_VERSIONS) else ""
            raise ImageVersionError(
                f"{where}: image format version {version}, this fanfs reads versions {known}{hint}"
            )
        zeroed = HEADER.pack(*fields[:2], 0, *fields[3:])
        if crc32(zeroed) != header_crc:
            raise CorruptCatalog(f"{where}: corrupt catalog header (checksum mismatch)")
        layout = _body_layout(n_entries, n_partitions, n_dicts, version)
        strings_at = layout[-1][2]
        if body_len != strings_at + strings_len + meta_len:
            raise CorruptCatalog(f"{where}: corrupt catalog header (inconsistent sizes)")
        if len(data) != HEADER.size + body_len:
            raise CorruptCatalog(
                f"{where}: truncated catalog ({len(data)} bytes, expected {HEADER.size + body_len})"
            )
        body = memoryview(data)[HEADER.size :]
        if hashlib.sha256(body).digest() != body_sha:
            raise CorruptCatalog(f"{where}: corrupt catalog (checksum mismatch)")
        columns = {
            name: np.frombuffer(body, dtype=dtype, count=count, offset=off)
            for name, dtype, off, count in layout[:-1]
        }
        if "blocks" not in columns:  # version 2: what fanfs reported before images had it
            columns["blocks"] = blocks_of_size(columns["size"]).astype("<u8")
        strings = bytes(body[strings_at : strings_at + strings_len])
        try:
            meta = json.loads(bytes(body[strings_at + strings_len :]))
        except ValueError:
            raise CorruptCatalog(f"{where}: corrupt catalog metadata") from None
        # Checked here, before the dictionaries are sliced out of the strings.
        if np.any(columns["dict_off"] + columns["dict_len"] > strings_len):
            raise CorruptCatalog(f"{where}: corrupt catalog (dictionary out of range)")
        # Checked before the constructor, which counts subdirectories by parent.
        if np.any(columns["parent"] >= n_entries):
            raise CorruptCatalog(f"{where}: corrupt catalog (parent out of range)")
        catalog = cls(columns, strings, meta, frame_size, version)
        catalog_check.check(catalog, where)
        return catalog

    # -- queries (pure, no I/O) ----------------------------------------------------------------

    def name(self, entry: int) -> bytes:
        off = int(self.name_off[entry])
        return self.strings[off : off + int(self.name_len[entry])]

    def lookup(self, parent: int, name: bytes) -> int | None:
        """Binary search of `name` among `parent`'s children (sorted by name bytes)."""
        lo = int(self.child_start[parent])
        hi = lo + int(self.child_count[parent])
        while lo < hi:
            mid = (lo + hi) // 2
            mid_name = self.name(mid)
            if mid_name < name:
                lo = mid + 1
            elif mid_name > name:
                hi = mid
            else:
                return mid
        return None

    def children(self, entry: int) -> range:
        start = int(self.child_start[entry])
        return range(start, start + int(self.child_count[entry]))

    def symlink_target(self, entry: int) -> bytes:
        off = int(self.data_off[entry])
        return self.strings[off : off + int(self.size[entry])]

    def path(self, entry: int) -> bytes:
        """The entry's path relative to the image root (for logs and reports)."""
        parts = []
        while entry != 0:
            parts.append(self.name(entry))
            entry = int(self.parent[entry])
        return b"/".join(reversed(parts))

    def resolve(self, path: bytes) -> int | None:
        entry = 0
        for part in path.split(b"/"):
            if part:
                found = self.lookup(entry, part)
                if found is None:
                    return None
                entry = found
        return entry

    def files_in_partition(self, part: int) -> np.ndarray:
        """Entry ids of the files stored in `part`, in on-disk order."""
        ids = np.flatnonzero(self.is_file & (self.part == part))
        return ids[np.argsort(self.data_off[ids], kind="stable")]

    def walk(self) -> Iterator[tuple[int, bytes]]:
        """(entry, path) of every entry except the root, parents before children."""
        paths = {0: b""}
        for entry in range(1, self.n_entries):
            parent = int(self.parent[entry])
            prefix = paths[parent]
            path = prefix + b"/" + self.name(entry) if prefix else self.name(entry)
            if self.is_dir[entry]:
                paths[entry] = path
            yield entry, path

    def memory_bytes(self) -> int:
        columns = (getattr(self, name) for name, _ in ENTRY_COLUMNS + PARTITION_COLUMNS)
        dicts = sum(len(d) for d in self.dicts)
        held = sum(c.nbytes for c in columns if c is not None)  # part_sha256: None before v4
        return int(held) + self.nlink.nbytes + len(self.strings) + dicts


def encode(
    columns: dict[str, np.ndarray],
    strings: bytes,
    meta: dict[str, Any],
    flags: int = 0,
    frame_size: int = 0,
    version: int = VERSION,
) -> bytes:
    """Serialise a catalog (the inverse of `Catalog.from_bytes`) in `version`'s layout (older
    ones lack columns, format.MISSING: for tests of old images). Without `dict_off` and
    `dict_len` columns the catalog has no dictionaries; without `blocks`, each entry's size
    rounded up to blocks; without `part_sha256`, zeros (no digest: keys from the CRCs)."""
    assert version in READ_VERSIONS, version
    n_entries = len(columns["parent"])
    n_partitions = len(columns["part_size"])
    defaults = {"dict_off": np.zeros(0, np.uint64), "dict_len": np.zeros(0, np.uint64),
                "blocks": blocks_of_size(np.asarray(columns["size"], dtype=np.uint64)),
                "part_sha256": np.zeros(n_partitions, "V32")}  # fmt: skip
    columns = defaults | columns
    n_dicts = len(columns["dict_off"])
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    body = bytearray()
    for name, dtype, off, _count in _body_layout(n_entries, n_partitions, n_dicts, version)[:-1]:
        assert len(body) == off
        raw = np.ascontiguousarray(columns[name], dtype=dtype).tobytes()
        body += raw + bytes(_padded(len(raw)) - len(raw))
    body += strings + meta_bytes
    fields = (MAGIC, version, 0, n_entries, n_partitions, flags, len(strings), len(meta_bytes),
              len(body), hashlib.sha256(body).digest(), n_dicts, frame_size)  # fmt: skip
    header_crc = crc32(HEADER.pack(*fields))
    return HEADER.pack(*fields[:2], header_crc, *fields[3:]) + bytes(body)
