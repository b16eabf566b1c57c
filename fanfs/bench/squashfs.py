"""The tool a single-node user picks instead of fanfs: a squashfs image of the same files under
`squashfuse_ll` (Debian's squashfs-tools and squashfuse), measured beside fanfs by `fanfs bench
--against squashfs`.

Built like fanfs's image: compressed with zstd at level 3 where fanfs compresses (`--compress
auto`), or with no compression at all where fanfs stores raw. Mounted by the user who runs the
bench (squashfuse_ll in the foreground, a child of the bench), and mounted afresh for every cold
pass: a new squashfuse_ll has no cache of its own, and the image's pages are dropped with
posix_fadvise, so its cold passes start as cold as fanfs's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from fanfs.bench.childmount import ChildMount
from fanfs.errors import FanfsError

TOOLS = ("mksquashfs", "squashfuse_ll")


def available() -> bool:
    return all(shutil.which(t) for t in TOOLS)


def build(src: Path, image: Path, compressed: bool) -> None:
    """A squashfs image of `src`: zstd level 3, or nothing compressed."""
    how = (["-comp", "zstd", "-Xcompression-level", "3"] if compressed
           else ["-noI", "-noD", "-noF", "-noX"])  # fmt: skip
    done = subprocess.run(["mksquashfs", str(src), str(image), "-noappend", "-quiet",
                           "-no-progress", "-processors", str(os.cpu_count() or 1), *how],
                          capture_output=True, text=True, timeout=3600, check=False)  # fmt: skip
    if done.returncode != 0:
        raise FanfsError(f"mksquashfs failed: {done.stderr.strip() or done.stdout.strip()}")


class Squash(ChildMount):
    """`squashfuse_ll IMAGE MOUNTPOINT`, remounted by `cold`."""

    def __init__(self, image: Path, mountpoint: Path):
        self.image = image
        super().__init__(["squashfuse_ll", "-f", str(image), str(mountpoint)], mountpoint,
                         "squashfuse_ll")  # fmt: skip

    def cold(self) -> None:
        """A fresh squashfuse_ll (no cache of its own) over an image whose pages are dropped;
        the old mount's pages go with it."""
        self.stop()
        fd = os.open(self.image, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self.mount()


@contextlib.contextmanager
def mounted(image: Path, mountpoint: Path) -> Iterator[Squash]:
    s = Squash(image, mountpoint)
    try:
        yield s
    finally:
        s.stop()
