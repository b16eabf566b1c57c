"""The end of prepare: the catalog written, the image's permissions set, the image renamed in."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from fanfs.image import catalog as cat
from fanfs.image import codec, imagedir
from fanfs.prepare.pack import Packer
from fanfs.prepare.source import Tree

log = logging.getLogger(__name__)


def write_catalog(tmp: Path, tree: Tree, packer: Packer, encoder: codec.Encoder, src: Path) -> None:
    strings = bytearray()
    name_off = np.zeros(len(tree.names), dtype=np.uint64)
    for i, name in enumerate(tree.names):
        name_off[i] = len(strings)
        strings += name
    data_off = packer.data_off.copy()  # symlinks point into the strings instead
    for entry, target in tree.links.items():
        data_off[entry] = len(strings)
        strings += target
    dict_off = np.zeros(len(encoder.dicts), dtype=np.uint64)
    for i, d in enumerate(encoder.dicts):
        dict_off[i] = len(strings)
        strings += d
    columns: dict[str, Any] = {
        "parent": tree.parent,
        "mode": tree.mode,
        "mtime_ns": tree.mtime_ns,
        "size": tree.size,
        "name_off": name_off,
        "name_len": [len(n) for n in tree.names],
        "child_start": tree.child_start,
        "child_count": tree.child_count,
        "part": packer.part,
        "data_off": data_off,
        "stored_len": packer.stored_len,
        "crc": packer.crc,
        "codec": packer.codec,
        "blocks": tree.blocks,
        "part_size": packer.part_size,
        "part_files": packer.part_files,
        "part_flags": packer.part_flags,
        "part_sha256": packer.digests(),
        "dict_off": dict_off,
        "dict_len": [len(d) for d in encoder.dicts],
    }
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": os.fsdecode(src),
        "compress": str(encoder.policy),
        "host": os.uname().nodename,
    }
    with open(tmp / cat.CATALOG_NAME, "wb") as f:
        arrays = {k: np.asarray(v) for k, v in columns.items()}
        f.write(cat.encode(arrays, bytes(strings), meta, frame_size=encoder.frame_size))
        f.flush()
        os.fsync(f.fileno())


def image_readers(tree: Tree, mode: str) -> int:
    """Who may read the image besides its owner (imagedir.GROUP/OTHERS), with a warning
    where SRC holds files that not every user may read."""
    files = [e for e, _ in tree.files]
    private = [e for e in files if tree.readers[e] != imagedir.EVERYONE]
    least = imagedir.EVERYONE
    for e in private:
        least &= tree.readers[e]
    who = least if mode == "auto" else imagedir.MODES[mode]
    if private:
        example = os.fsdecode(tree.files[files.index(private[0])][1])
        exposed = [e for e in private if tree.readers[e] & who != who]
        log.warning(
            "%d of %d files in the source are not readable by every user (e.g. %s); the image "
            "will be readable by %s%s", len(private), len(files), example,
            imagedir.describe(who),
            f": --mode {mode} exposes {len(exposed)} of them" if exposed else
            " (--mode public|group to share it)",
        )  # fmt: skip
    return who


def publish(tmp: Path, image: Path, who: int, umask: bool, force: bool) -> None:
    """Give the image its permissions, then rename it into place; an old image (with --force,
    checked to be one) goes only after the new one is in place."""
    dir_mode, file_mode = imagedir.permissions(who)
    if umask:
        mask = imagedir.umask()
        dir_mode, file_mode = dir_mode & ~mask | 0o700, file_mode & ~mask | 0o600
    for name in os.listdir(tmp):
        os.chmod(tmp / name, file_mode, follow_symlinks=False)
    old = None
    if image.exists() or image.is_symlink():
        imagedir.check_replaceable(image, force)  # again: it may have appeared or changed
        old = imagedir.old_path(image)
        image.rename(old)
    os.chmod(tmp, dir_mode)
    tmp.rename(image)
    dir_fd = os.open(image.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if old is not None:
        imagedir.remove(old)
