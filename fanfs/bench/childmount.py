"""A file system the bench measures beside fanfs, served by a child process in the foreground
(squashfuse_ll, fanfs-floor): mounted by the user who runs the bench, unmounted lazily and its
process ended from SIGTERM to SIGKILL, so that a bench that fails leaves no mount behind."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

from fanfs import mounts
from fanfs.errors import FanfsError

MOUNT_WAIT_S = 30  # a FUSE server that has not mounted by then will not


class ChildMount:
    """`argv`, a FUSE server whose last argument is `mountpoint`, kept mounted until `stop`;
    `answers`: its standard output is kept, for what it says back (else it goes nowhere)."""

    def __init__(self, argv: list[str], mountpoint: Path, what: str, answers: bool = False):
        self.argv = argv
        self.answers = answers
        self.mountpoint = mountpoint
        self.what = what
        self.proc: subprocess.Popen[bytes] | None = None
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mount()

    def mount(self) -> None:
        out = subprocess.PIPE if self.answers else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.PIPE)
        deadline = time.monotonic() + MOUNT_WAIT_S
        try:
            while mounts.find(self.mountpoint) is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    said = self._said().strip()  # (before stop, which closes its pipes)
                    raise FanfsError(f"{self.what} did not mount {self.mountpoint}: "
                                     f"{said or 'no error printed'}")  # fmt: skip
                time.sleep(0.02)
        except BaseException:  # also a stop signal (the bench's KeyboardInterrupt): no leftovers
            self.stop()
            raise

    def _said(self) -> str:
        if self.proc is None or self.proc.stderr is None or self.proc.poll() is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")

    def stop(self) -> None:
        if mounts.find(self.mountpoint) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], timeout=30,
                           capture_output=True, check=False)  # fmt: skip
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        self.proc = None

    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid
