"""The source side of prepare: walking SRC into catalog columns, reading files, partition count.

The walk is breadth-first, so each directory's children get contiguous, sorted entry ids, and
never follows symlinks. Each entry records who besides its owner may read it (imagedir)."""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import stat
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fanfs.errors import SourceError
from fanfs.image import imagedir
from fanfs.prepare.interrupt import stop

log = logging.getLogger(__name__)

# Default partition count: one per 64 MiB stored, at least 16 so that a small dataset still
# spreads over many ranks, at most 1024 so a node never juggles thousands of staged files.
PART_TARGET_BYTES = 64 << 20
MIN_PARTITIONS = 16
MAX_PARTITIONS = 1024


@dataclass
class Tree:
    """The walked source: catalog columns as Python lists, plus what packing needs."""

    names: list[bytes] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    mode: list[int] = field(default_factory=list)
    mtime_ns: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # st_blocks as the source reports it
    child_start: list[int] = field(default_factory=list)
    child_count: list[int] = field(default_factory=list)
    links: dict[int, bytes] = field(default_factory=dict)
    files: list[tuple[int, bytes]] = field(default_factory=list)  # (entry, absolute path)
    skipped: int = 0
    # Who besides the owner can read each entry (imagedir.readers), and the image's group.
    readers: list[int] = field(default_factory=list)
    image_gid: int | None = None

    def add(self, name: bytes, parent: int, st: os.stat_result, above: int) -> int:
        self.readers.append(imagedir.readers(st, self.image_gid, above))
        self.names.append(name)
        self.parent.append(parent)
        self.mode.append(st.st_mode)
        self.mtime_ns.append(st.st_mtime_ns)
        self.size.append(st.st_size)
        # From lstat, for symlinks and directories too: what the source allocated, holes left
        # out, so that du and cp --sparse=auto see through the mount what they saw in SRC.
        self.blocks.append(st.st_blocks)
        self.child_start.append(0)
        self.child_count.append(0)
        return len(self.names) - 1


def _scan(path: bytes) -> list[os.DirEntry[bytes]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read directory: {e.strerror}") from None


def walk(src: Path, image_gid: int | None = None) -> Tree:
    """Breadth-first walk of `src`, not following symlinks."""
    root = os.fsencode(src)
    try:
        st = os.stat(root)
    except OSError as e:
        raise SourceError(f"{src}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"{src}: not a directory")
    tree = Tree(image_gid=image_gid)
    tree.add(b"", 0, st, imagedir.reach(src, image_gid))
    queue: deque[tuple[int, bytes]] = deque([(0, root)])
    while queue:
        stop.check()
        parent, path = queue.popleft()
        tree.child_start[parent] = len(tree.names)
        for entry in _scan(path):
            full = os.path.join(path, entry.name)
            try:
                est = entry.stat(follow_symlinks=False)
                target = os.readlink(full) if stat.S_ISLNK(est.st_mode) else None
            except OSError as e:
                raise SourceError(f"{os.fsdecode(full)}: {e.strerror}") from None
            fmt = stat.S_IFMT(est.st_mode)
            if fmt not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
                log.warning("skipping %s: not a file, directory or symlink", os.fsdecode(full))
                tree.skipped += 1
                continue
            idx = tree.add(entry.name, parent, est, tree.readers[parent])
            if fmt == stat.S_IFDIR:
                queue.append((idx, full))
            elif fmt == stat.S_IFREG:
                tree.files.append((idx, full))
            else:
                assert target is not None
                tree.links[idx] = target
                tree.size[idx] = len(target)
        tree.child_count[parent] = len(tree.names) - tree.child_start[parent]
    return tree


def match_globs(tree: Tree, root: bytes, globs: Sequence[str]) -> set[int]:
    """Entries of the files whose path relative to SRC matches a glob (`*` crosses `/`)."""
    if not globs:
        return set()
    cut = len(root) + 1
    return {
        entry
        for entry, path in tree.files
        if any(fnmatch.fnmatchcase(os.fsdecode(path[cut:]), g) for g in globs)
    }


def default_partitions(total_bytes: int, n_files: int) -> int:
    wanted = math.ceil(total_bytes / PART_TARGET_BYTES)
    return max(1, min(max(MIN_PARTITIONS, min(wanted, MAX_PARTITIONS)), n_files))


def read_file(path: bytes, size: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except OSError as e:
        raise SourceError(f"{os.fsdecode(path)}: cannot read: {e.strerror}") from None
    if len(data) != size:
        raise SourceError(f"{os.fsdecode(path)}: changed size while preparing")
    return data
