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
- Regular files point into a partition (`part`, `data_off`, `stored_len`) that lies within the
  partition's recorded size; symlinks keep their target in the string table.
The catalog is immutable after load: it needs no locks and is shared by every task and thread.
Memory: 69 bytes per entry in the columns plus the names, no Python object per entry.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.checksum import crc32
from fanfs.errors import CorruptCatalog, ImageError, ImageVersionError

MAGIC = b"FANFSCAT"
VERSION = 2
CATALOG_NAME = "catalog.fanfs"
NO_PARTITION = 0xFFFFFFFF

# Codec ids stored per file. New codecs get new ids; a reader refuses ids it does not know.
CODEC_RAW = 0
CODEC_ZSTD = 1  # one zstd frame
CODEC_ZSTD_DICT = 2  # one zstd frame made with the catalog dictionary its header names
CODEC_FRAMED = 3  # independent frames of `frame_size` bytes each, then a table of them
CODEC_ZSTD_DELTA4 = 4  # one zstd frame of the delta4 filter's output (docs/format.md)
CODEC_ZSTD_FILTERED = 5  # a filter id byte (fanfs/filters.py), then one zstd frame of its output
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd-dict",
               CODEC_FRAMED: "framed", CODEC_ZSTD_DELTA4: "zstd-delta4",
               CODEC_ZSTD_FILTERED: "zstd-filtered"}  # fmt: skip
# A framed file's table: per frame, (stored length, CRC-32 of the stored frame), u32 each.
# The length's low 28 bits are the stored length, its top 4 bits the filter the frame went
# through before zstd (0: none; delta4's id 8 is the top bit alone, as format 2 began).
FRAME_ENTRY = 8
FRAME_FILTER_SHIFT = 28
FRAME_LEN_MASK = (1 << FRAME_FILTER_SHIFT) - 1

S_IFMT = 0o170000  # the file-type bits of st_mode (stat.S_IFMT is a function)
NAME_MAX = 255  # bytes in one name, as in every Linux file system (FUSE refuses longer ones)
# A file compressed whole is decoded whole in memory. prepare frames every compressed file over
# 4 MiB, so a catalog that claims a larger whole-compressed file is hostile.
WHOLE_DECODE_MAX = 4 << 20
# The decoded bytes per frame of a framed file: prepare writes this one size. Another (up to
# 256 MiB would fit the table's 28 bits) could make every decode cost a GiB: refused.
FRAME_SIZE = 1 << 20
_WORD = 8  # bytes of a name compared at a time when checking the order of names
_CHUNK = 1 << 18  # name pairs compared per numpy pass (bounds the check's memory)

# Partition flags (bit set).
PART_BROADCAST = 1

# magic, version, header_crc, n_entries, n_partitions, flags, strings_len, meta_len, body_len,
# body_sha256, n_dicts, frame_size. header_crc is the CRC-32 of the header with it zeroed.
HEADER = struct.Struct("<8sIIQIIQQQ32sII")

# Column order and types are part of the format (docs/format.md). Entry columns first.
ENTRY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("parent", "<u4"),
    ("mode", "<u4"),
    ("mtime_ns", "<i8"),
    ("size", "<u8"),
    ("name_off", "<u8"),
    ("name_len", "<u4"),
    ("child_start", "<u4"),
    ("child_count", "<u4"),
    ("part", "<u4"),
    ("data_off", "<u8"),  # files: offset in the partition; symlinks: offset in the strings
    ("stored_len", "<u8"),
    ("crc", "<u4"),  # CRC-32 of the stored bytes
    ("codec", "<u1"),
)
PARTITION_COLUMNS: tuple[tuple[str, str], ...] = (
    ("part_size", "<u8"),
    ("part_files", "<u8"),
    ("part_flags", "<u4"),
)
DICT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("dict_off", "<u8"),  # offset of dictionary i (zstd dict id i + 1) in the string table
    ("dict_len", "<u8"),
)
ALIGN = 8  # every column starts 8-byte aligned so np.frombuffer views need no copy


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


def partition_name(part: int) -> str:
    return f"part-{part:05d}.pack"


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def n_frames(size: Any, frame_size: int) -> Any:
    """Frames of a framed file of `size` bytes (works on numpy columns too; never wraps
    around, even for a size near 2**64)."""
    return size // frame_size + (size % frame_size != 0)


def _body_layout(
    n_entries: int, n_partitions: int, n_dicts: int
) -> list[tuple[str, str, int, int]]:
    """(name, dtype, offset, count) of each column within the body."""
    layout = []
    pos = 0
    sections = ((ENTRY_COLUMNS, n_entries), (PARTITION_COLUMNS, n_partitions),
                (DICT_COLUMNS, n_dicts))  # fmt: skip
    for columns, count in sections:
        for name, dtype in columns:
            layout.append((name, dtype, pos, count))
            pos += _padded(np.dtype(dtype).itemsize * count)
    layout.append(("strings", "u1", pos, -1))
    return layout


class Catalog:
    """A loaded, validated catalog. Read-only."""

    def __init__(
        self,
        columns: dict[str, np.ndarray],
        strings: bytes,
        meta: dict[str, Any],
        frame_size: int = 0,
    ):
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
        self.part_size = columns["part_size"]
        self.part_files = columns["part_files"]
        self.part_flags = columns["part_flags"]
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
        if version != VERSION:
            hint = " (prepare the image again)" if version < VERSION else ""
            raise ImageVersionError(
                f"{where}: image format version {version}, this fanfs reads version {VERSION}{hint}"
            )
        zeroed = HEADER.pack(*fields[:2], 0, *fields[3:])
        if crc32(zeroed) != header_crc:
            raise CorruptCatalog(f"{where}: corrupt catalog header (checksum mismatch)")
        layout = _body_layout(n_entries, n_partitions, n_dicts)
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
        catalog = cls(columns, strings, meta, frame_size)
        catalog._check_structure(where)
        return catalog

    def _check_structure(self, where: str) -> None:
        """Vectorised sanity checks: a catalog that passes cannot send a read out of bounds."""
        n = self.n_entries

        def bad(what: str) -> CorruptCatalog:
            return CorruptCatalog(f"{where}: corrupt catalog ({what})")

        if n == 0 or not self.is_dir[0]:
            raise bad("no root directory")
        if np.any(self.parent >= n):
            raise bad("parent out of range")
        # Offsets are checked alone too: a sum of two u64 columns can wrap around.
        if np.any(self.name_off > len(self.strings)) or np.any(
            self.name_off + self.name_len > len(self.strings)
        ):
            raise bad("name out of range")
        # A device node, fifo or socket in a hostile image would be honoured by the kernel.
        if np.any(~(self.is_dir | self.is_file | self.is_link)):
            raise bad("entry that is not a directory, file or symlink")
        self._check_tree(bad)
        self._check_names(bad)
        if np.any(self.child_start.astype(np.uint64) + self.child_count > n):
            raise bad("children out of range")
        if not np.all(np.isin(self.codec, list(CODEC_NAMES))):
            raise bad("unknown codec")
        files = self.is_file
        if np.any(self.codec[files] == CODEC_ZSTD_DICT) and not self.dicts:
            raise bad("dictionary codec without dictionaries")
        framed = files & (self.codec == CODEC_FRAMED)
        if np.any(framed):
            if self.frame_size != FRAME_SIZE:
                raise bad(f"framed files with a frame size of {self.frame_size}, not "
                          f"{FRAME_SIZE} as prepare writes")  # fmt: skip
            tables = n_frames(self.size[framed], self.frame_size) * FRAME_ENTRY
            if np.any(self.stored_len[framed] < tables):
                raise bad("framed file shorter than its frame table")
        if np.any(self.part[files] >= self.n_partitions):
            raise bad("partition out of range")
        limit = self.part_size[self.part[files]]
        ends = self.data_off[files] + self.stored_len[files]
        if (
            np.any(self.data_off[files] > limit)
            or np.any(self.stored_len[files] > limit)
            or np.any(ends > limit)
        ):
            raise bad("file data beyond its partition")
        raw = files & (self.codec == CODEC_RAW)
        if np.any(self.stored_len[raw] != self.size[raw]):
            raise bad("raw file whose stored length is not its size")
        whole = files & ~raw & ~framed
        if np.any(self.size[whole] > WHOLE_DECODE_MAX) or np.any(self.stored_len[whole] == 0):
            raise bad("compressed file of an impossible size")
        links = self.is_link
        ends = self.data_off[links] + self.size[links]
        if np.any(self.data_off[links] > len(self.strings)) or np.any(ends > len(self.strings)):
            raise bad("symlink target out of range")

    def _check_tree(self, bad: Callable[[str], CorruptCatalog]) -> None:
        """Walk order: parents first, each directory's children exactly its own range."""
        n = self.n_entries
        if np.any(self.parent[1:] >= np.arange(1, n, dtype=np.uint64)):
            raise bad("a parent after its child")
        if np.any(self.child_count[~self.is_dir] != 0):
            raise bad("children of a non-directory")
        dirs = np.flatnonzero(self.is_dir & (self.child_count > 0))
        dirs = dirs[np.argsort(self.child_start[dirs], kind="stable")]
        starts = self.child_start[dirs].astype(np.int64)
        counts = self.child_count[dirs].astype(np.int64)
        if int(counts.sum()) != n - 1 or (len(dirs) and starts[0] != 1):
            raise bad("children that do not cover every entry once")
        if np.any(starts[1:] != starts[:-1] + counts[:-1]):
            raise bad("overlapping or gapped children")
        if np.any(self.parent[1:] != np.repeat(dirs, counts)):
            raise bad("an entry outside its parent's children")

    def _check_names(self, bad: Callable[[str], CorruptCatalog]) -> None:
        """Names are valid path components, sorted and unique within each directory."""
        lens = self.name_len[1:]
        if np.any(lens == 0) or np.any(lens > NAME_MAX):
            raise bad("name empty or longer than 255 bytes")
        table = np.frombuffer(self.strings, dtype=np.uint8)
        offs = self.name_off[1:]
        forbidden = np.flatnonzero((table == ord("/")) | (table == 0)).astype(np.uint64)
        inside = np.searchsorted(forbidden, offs + lens) - np.searchsorted(forbidden, offs)
        if np.any(inside):
            raise bad("name containing '/' or NUL")
        if len(table):
            first = table[np.minimum(offs, len(table) - 1)]
            second = table[np.minimum(offs + 1, len(table) - 1)]
            dot = ord(".")
            if np.any((first == dot) & ((lens == 1) | ((lens == 2) & (second == dot)))):
                raise bad("name '.' or '..'")
        # Neighbours in one directory compare word by word (big-endian, zero padded, which
        # orders like bytes since names hold no NUL); only tied pairs go on to the next word.
        pairs = np.flatnonzero(self.parent[1:-1] == self.parent[2:]) + 1
        for lo in range(0, len(pairs), _CHUNK):
            a = pairs[lo : lo + _CHUNK]
            b = a + 1
            k = 0
            while len(a):
                wa, wb = self._name_word(table, a, k), self._name_word(table, b, k)
                if np.any(wa > wb):
                    raise bad("names not sorted within a directory")
                tied = wa == wb
                upto = _WORD * (k + 1)
                ended = (self.name_len[a] <= upto) & (self.name_len[b] <= upto)
                if np.any(tied & ended):
                    raise bad("duplicate names within a directory")
                a, b, k = a[tied], b[tied], k + 1

    def _name_word(self, table: np.ndarray, entries: np.ndarray, k: int) -> np.ndarray:
        """Bytes [8k, 8k + 8) of each entry's name as a big-endian u64, zero padded."""
        start = self.name_off[entries] + np.uint64(_WORD * k)
        pos = start[:, None] + np.arange(_WORD, dtype=np.uint64)
        end = self.name_off[entries] + self.name_len[entries]
        got = np.where(pos < end[:, None], table[np.minimum(pos, len(table) - 1)], 0)
        shifts = np.arange(8 * (_WORD - 1), -1, -8, dtype=np.uint64)
        words: np.ndarray = (got.astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)
        return words

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
        return int(sum(c.nbytes for c in columns)) + self.nlink.nbytes + len(self.strings) + dicts


def encode(
    columns: dict[str, np.ndarray],
    strings: bytes,
    meta: dict[str, Any],
    flags: int = 0,
    frame_size: int = 0,
) -> bytes:
    """Serialise a catalog (the inverse of `Catalog.from_bytes`). Without `dict_off` and
    `dict_len` columns the catalog has no dictionaries."""
    n_entries = len(columns["parent"])
    n_partitions = len(columns["part_size"])
    columns = {"dict_off": np.zeros(0, np.uint64), "dict_len": np.zeros(0, np.uint64)} | columns
    n_dicts = len(columns["dict_off"])
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    body = bytearray()
    for name, dtype, off, _count in _body_layout(n_entries, n_partitions, n_dicts)[:-1]:
        assert len(body) == off
        raw = np.ascontiguousarray(columns[name], dtype=dtype).tobytes()
        body += raw + bytes(_padded(len(raw)) - len(raw))
    body += strings + meta_bytes
    fields = (MAGIC, VERSION, 0, n_entries, n_partitions, flags, len(strings), len(meta_bytes),
              len(body), hashlib.sha256(body).digest(), n_dicts, frame_size)  # fmt: skip
    header_crc = crc32(HEADER.pack(*fields))
    return HEADER.pack(*fields[:2], header_crc, *fields[3:]) + bytes(body)
