"""The checks a catalog passes before anything uses it: a hostile catalog is refused at load,
with one line naming what is wrong (exit 4), and a catalog that passes cannot send a read out
of bounds. Each check says why; all are vectorised (about 0.8 s per million entries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fanfs.errors import CorruptCatalog
from fanfs.image.format import (
    _CHUNK,
    _WORD,
    BLOCKS_MAX,
    CODEC_FRAMED,
    CODEC_NAMES,
    CODEC_RAW,
    CODEC_ZSTD_DICT,
    FRAME_ENTRY,
    FRAME_SIZE,
    NAME_MAX,
    WHOLE_DECODE_MAX,
    n_frames,
)

# The catalog being checked (fanfs/image/catalog.py's Catalog, not imported: it imports this).
Catalog = Any


def check(c: Catalog, where: str) -> None:
    """Vectorised sanity checks: a catalog that passes cannot send a read out of bounds."""
    n = c.n_entries

    def bad(what: str) -> CorruptCatalog:
        return CorruptCatalog(f"{where}: corrupt catalog ({what})")

    if n == 0 or not c.is_dir[0]:
        raise bad("no root directory")
    if np.any(c.parent >= n):
        raise bad("parent out of range")
    # Offsets are checked alone too: a sum of two u64 columns can wrap around.
    if np.any(c.name_off > len(c.strings)) or np.any(c.name_off + c.name_len > len(c.strings)):
        raise bad("name out of range")
    # A device node, fifo or socket in a hostile image would be honoured by the kernel.
    if np.any(~(c.is_dir | c.is_file | c.is_link)):
        raise bad("entry that is not a directory, file or symlink")
    _tree(c, bad)
    _names(c, bad)
    if np.any(c.child_start.astype(np.uint64) + c.child_count > n):
        raise bad("children out of range")
    if not np.all(np.isin(c.codec, list(CODEC_NAMES))):
        raise bad("unknown codec")
    files = c.is_file
    if np.any(c.codec[files] == CODEC_ZSTD_DICT) and not c.dicts:
        raise bad("dictionary codec without dictionaries")
    framed = files & (c.codec == CODEC_FRAMED)
    if np.any(framed):
        if c.frame_size != FRAME_SIZE:
            raise bad(f"framed files with a frame size of {c.frame_size}, not "
                      f"{FRAME_SIZE} as prepare writes")  # fmt: skip
        tables = n_frames(c.size[framed], c.frame_size) * FRAME_ENTRY
        if np.any(c.stored_len[framed] < tables):
            raise bad("framed file shorter than its frame table")
    if np.any(c.part[files] >= c.n_partitions):
        raise bad("partition out of range")
    limit = c.part_size[c.part[files]]
    ends = c.data_off[files] + c.stored_len[files]
    if (
        np.any(c.data_off[files] > limit)
        or np.any(c.stored_len[files] > limit)
        or np.any(ends > limit)
    ):
        raise bad("file data beyond its partition")
    raw = files & (c.codec == CODEC_RAW)
    if np.any(c.stored_len[raw] != c.size[raw]):
        raise bad("raw file whose stored length is not its size")
    whole = files & ~raw & ~framed
    if np.any(c.size[whole] > WHOLE_DECODE_MAX) or np.any(c.stored_len[whole] == 0):
        raise bad("compressed file of an impossible size")
    # stat's users multiply st_blocks by 512 into a signed 64-bit count (du; pyfuse3's blkcnt_t
    # refuses more, which would turn every stat of the entry into EIO).
    if np.any(c.blocks > BLOCKS_MAX):
        raise bad("allocated blocks beyond 2**63 bytes")
    links = c.is_link
    ends = c.data_off[links] + c.size[links]
    if np.any(c.data_off[links] > len(c.strings)) or np.any(ends > len(c.strings)):
        raise bad("symlink target out of range")


def _tree(c: Catalog, bad: Callable[[str], CorruptCatalog]) -> None:
    """Walk order: parents first, each directory's children exactly its own range."""
    n = c.n_entries
    if np.any(c.parent[1:] >= np.arange(1, n, dtype=np.uint64)):
        raise bad("a parent after its child")
    if np.any(c.child_count[~c.is_dir] != 0):
        raise bad("children of a non-directory")
    dirs = np.flatnonzero(c.is_dir & (c.child_count > 0))
    dirs = dirs[np.argsort(c.child_start[dirs], kind="stable")]
    starts = c.child_start[dirs].astype(np.int64)
    counts = c.child_count[dirs].astype(np.int64)
    if int(counts.sum()) != n - 1 or (len(dirs) and starts[0] != 1):
        raise bad("children that do not cover every entry once")
    if np.any(starts[1:] != starts[:-1] + counts[:-1]):
        raise bad("overlapping or gapped children")
    if np.any(c.parent[1:] != np.repeat(dirs, counts)):
        raise bad("an entry outside its parent's children")


def _names(c: Catalog, bad: Callable[[str], CorruptCatalog]) -> None:
    """Names are valid path components, sorted and unique within each directory."""
    lens = c.name_len[1:]
    if np.any(lens == 0) or np.any(lens > NAME_MAX):
        raise bad("name empty or longer than 255 bytes")
    table = np.frombuffer(c.strings, dtype=np.uint8)
    offs = c.name_off[1:]
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
    pairs = np.flatnonzero(c.parent[1:-1] == c.parent[2:]) + 1
    for lo in range(0, len(pairs), _CHUNK):
        a = pairs[lo : lo + _CHUNK]
        b = a + 1
        k = 0
        while len(a):
            wa, wb = _name_word(c, table, a, k), _name_word(c, table, b, k)
            if np.any(wa > wb):
                raise bad("names not sorted within a directory")
            tied = wa == wb
            upto = _WORD * (k + 1)
            ended = (c.name_len[a] <= upto) & (c.name_len[b] <= upto)
            if np.any(tied & ended):
                raise bad("duplicate names within a directory")
            a, b, k = a[tied], b[tied], k + 1


def _name_word(c: Catalog, table: np.ndarray, entries: np.ndarray, k: int) -> np.ndarray:
    """Bytes [8k, 8k + 8) of each entry's name as a big-endian u64, zero padded."""
    start = c.name_off[entries] + np.uint64(_WORD * k)
    pos = start[:, None] + np.arange(_WORD, dtype=np.uint64)
    end = c.name_off[entries] + c.name_len[entries]
    got = np.where(pos < end[:, None], table[np.minimum(pos, len(table) - 1)], 0)
    shifts = np.arange(8 * (_WORD - 1), -1, -8, dtype=np.uint64)
    words: np.ndarray = (got.astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)
    return words
