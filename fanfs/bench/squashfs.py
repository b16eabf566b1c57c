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
import time
from collections.abc import Iterator
from pathlib import Path

from fanfs import mounts
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


class Squash:
    """`squashfuse_ll IMAGE MOUNTPOINT`, remounted by `cold`."""

    def __init__(self, image: Path, mountpoint: Path):
        self.image = image
        self.mountpoint = mountpoint
        self.proc: subprocess.Popen[bytes] | None = None
        mountpoint.mkdir(parents=True, exist_ok=True)
        self._mount()

    def _mount(self) -> None:
        self.proc = subprocess.Popen(["squashfuse_ll", "-f", str(self.image), str(self.mountpoint)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 30
        while mounts.find(self.mountpoint) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.stop()
                raise FanfsError(f"squashfuse_ll did not mount {self.image}: {err.strip()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if mounts.find(self.mountpoint) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], timeout=30,
                           capture_output=True, check=False)  # fmt: skip
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None

    def cold(self) -> None:
        """A fresh squashfuse_ll (no cache of its own) over an image whose pages are dropped;
        the old mount's pages go with it."""
        self.stop()
        fd = os.open(self.image, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self._mount()

    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@contextlib.contextmanager
def mounted(image: Path, mountpoint: Path) -> Iterator[Squash]:
    s = Squash(image, mountpoint)
    try:
        yield s
    finally:
        s.stop()
