"""The FUSE floor: the same files served by the least a FUSE file system in user space does
(`fanfs-floor`, fanfs/bench/floor.c: libfuse's multi-threaded loop, a `pread` of the source
file per READ, nothing else), measured beside fanfs by `fanfs bench --against floor`.

What fanfs costs over native reads is partly FUSE's own (a round trip per request, the kernel's
copy of every reply); this side shows how much on the machine at hand, so that fanfs/floor is
what fanfs itself adds and floor/native what FUSE does. Built by the bench with the machine's C
compiler against libfuse 3 (pkg-config fuse3, from tools/setup_system.sh), in the bench's
scratch directory. Its cold passes drop the mount's pages (the server asks the kernel to, on
SIGUSR1) and the source files' (as native's are); directory entries stay, as fanfs's do.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from fanfs.bench.childmount import ChildMount
from fanfs.errors import FanfsError

SOURCE = Path(__file__).with_name("floor.c")
DROP_WAIT_S = 60  # the server invalidates each known file's pages; thousands take a second


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def available() -> bool:
    return (
        compiler() is not None
        and shutil.which("pkg-config") is not None
        and subprocess.run(
            ["pkg-config", "--exists", "fuse3"], capture_output=True, check=False
        ).returncode
        == 0
    )


def build(out: Path) -> Path:
    """fanfs-floor compiled into `out` (a directory), once: a bench run's datasets share it.
    FanfsError when it cannot be."""
    exe = out / "fanfs-floor"
    if exe.exists():
        return exe
    cc = compiler()
    if cc is None:
        raise FanfsError("bench: no C compiler (cc) to build fanfs-floor")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                           text=True, check=False)  # fmt: skip
    if flags.returncode != 0:
        raise FanfsError(f"bench: pkg-config fuse3: {flags.stderr.strip()} (libfuse3-dev)")
    done = subprocess.run([cc, "-O2", "-o", str(exe), str(SOURCE), *flags.stdout.split(),
                           "-lpthread"], capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise FanfsError(f"bench: building fanfs-floor failed: {done.stderr.strip()}")
    return exe


class Floor(ChildMount):
    """`fanfs-floor [--poll] SRC MOUNTPOINT`; `cold` drops its mount's pages."""

    def __init__(self, exe: Path, src: Path, mountpoint: Path, poll: bool):
        argv = [str(exe), *(["--poll"] if poll else []), str(src), str(mountpoint)]
        super().__init__(argv, mountpoint, "fanfs-floor", answers=True)

    def cold(self) -> None:
        """The kernel's pages of every file the server has served, dropped; waits until done."""
        assert self.proc is not None and self.proc.stdout is not None
        os.kill(self.proc.pid, signal.SIGUSR1)
        out = self.proc.stdout.fileno()
        deadline = time.monotonic() + DROP_WAIT_S
        said = b""
        while not said.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                raise FanfsError("bench: fanfs-floor did not drop its pages in time")
            more = os.read(out, 64)
            if not more:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                raise FanfsError(f"bench: fanfs-floor ended: {self._said().strip()}")
            said += more
        if said != b"dropped\n":
            raise FanfsError(f"bench: fanfs-floor could not drop its pages: {said!r}")


@contextlib.contextmanager
def mounted(src: Path, where: Path, exe: Path) -> Iterator[dict[str, Floor]]:
    """Both floors over `src` (`exe`, from `build`), mounted under `where` and unmounted on
    the way out: "floor" (libfuse's threads) and "floor-poll" (one thread that polls)."""
    with contextlib.ExitStack() as stack:
        floors = {}
        for name, poll in (("floor", False), ("floor-poll", True)):
            floors[name] = f = Floor(exe, src, where / f"mnt-{name}", poll)
            stack.callback(f.stop)
        yield floors
