"""zstd dictionaries for groups of small files (same extension), trained during prepare."""

from __future__ import annotations

import logging
import os

from fanfs.image import catalog as cat
from fanfs.image import codec, imagedir
from fanfs.prepare.interrupt import stop
from fanfs.prepare.source import Tree, read_file

log = logging.getLogger(__name__)

# Dictionaries: one per group of small files (same extension) with enough files to pay for
# it, trained on up to DICT_SAMPLE_FILES files spread over the group (walk order, so the image
# is the same every time), at most DICT_SAMPLE_BYTES of them.
DICT_SIZE = 64 << 10
DICT_MIN_FILES = 64
DICT_SAMPLE_FILES = 2000
DICT_SAMPLE_BYTES = 8 << 20
MAX_DICTS = 64


def group(path: bytes) -> bytes:
    """Which files share a dictionary: those with the same extension (case folded)."""
    return cat.extension(path.rsplit(b"/", 1)[-1])


def train_dictionaries(
    tree: Tree, policy: codec.Policy, who: int = imagedir.EVERYONE
) -> tuple[list[bytes], dict[bytes, int]]:
    """Dictionaries for the groups of small files, and which group uses which (id = index + 1).

    A dictionary holds pieces of its samples and goes into the catalog, which every reader of
    the image can read: a file that fewer users may read than `who` (the image's readers) is
    never a sample."""
    groups: dict[bytes, list[tuple[bytes, int]]] = {}
    for entry, path in tree.files:
        size = tree.size[entry]
        if 0 < size <= codec.DICT_MAX_FILE and tree.readers[entry] & who == who:
            groups.setdefault(group(path), []).append((path, size))
    ranked = sorted(
        ((sum(n for _, n in files), key, files) for key, files in groups.items()
         if len(files) >= DICT_MIN_FILES),
        key=lambda g: (-g[0], g[1]),
    )  # fmt: skip
    dicts: list[bytes] = []
    ids: dict[bytes, int] = {}
    for _, key, files in ranked[:MAX_DICTS]:
        stop.check()
        samples: list[bytes] = []
        taken = 0
        for path, size in files[:: max(1, len(files) // DICT_SAMPLE_FILES)]:
            if taken + size > DICT_SAMPLE_BYTES:
                break
            samples.append(read_file(path, size))
            taken += size
        if policy.mode == "auto":
            packed = sum(codec.already_compressed(x[:16]) for x in samples)
            if packed * 2 > len(samples):
                log.info("no dictionary for %r files: compressed already", os.fsdecode(key))
                continue
        try:
            trained = codec.train_dictionary(
                min(DICT_SIZE, taken // 8), samples, len(dicts) + 1, policy.level
            )
        except ValueError as e:  # too few or too uniform samples: no dictionary
            log.info("no dictionary for %r files: %s", os.fsdecode(key), e)
            continue
        dicts.append(trained)
        ids[key] = len(dicts)
    if dicts:
        names = ", ".join(repr(os.fsdecode(k) or "(no extension)") for k in ids)
        log.info("trained %d dictionaries (%s)", len(dicts), names)
    return dicts, ids
