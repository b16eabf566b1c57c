"""A partition file of the image: checked before mounting (present, regular, of the size the
catalog gives), read exactly (a short read is EIO, never short data), reopened O_DIRECT. No
state: any thread.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from fanfs import native
from fanfs.errors import MissingPartition
from fanfs.image import catalog as cat


def pread_exact(fd: int, length: int, offset: int, what: str) -> bytes:
    """Exactly `length` bytes at `offset`; a short read (a truncated file) is EIO."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(errno.EIO, f"short read from {what} ({len(data)} of {length} bytes)")
    return data


def check_partitions(image: Path, catalog: cat.Catalog, parts: Sequence[int]) -> None:
    """Fail before mounting if a partition file is missing or has the wrong size."""
    for p in parts:
        path = image / cat.partition_name(p)
        try:
            st = path.stat()
        except OSError as e:
            raise MissingPartition(f"{path}: partition missing ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise MissingPartition(f"{path}: partition is not a regular file")
        size = st.st_size
        if size != int(catalog.part_size[p]):
            raise MissingPartition(
                f"{path}: partition truncated or wrong ({size} bytes, expected "
                f"{int(catalog.part_size[p])})"
            )


def open_direct(fd: int) -> int:
    """`fd`'s file opened again with O_DIRECT, read-only, or -1 when its file system cannot
    (tmpfs, some network file systems) or /proc is not there."""
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1
    if not native.lib.direct_ok(dfd):
        os.close(dfd)
        return -1
    return dfd
