"""The output mount's front: the C threads answering WRITEs (fanfs/csrc/front.c, writes.c),
started after the mount and stopped before the unmount, in one place.

One thread takes requests (a WRITE costs it a buffer swap and an answer); its writer thread
does the pwrites into the file's local data through the handle (view.py). A WRITE answered
and not yet written lives in a file (writes.c, "Kept"; `kept_places`): a SIGKILL loses none
(recover.py writes them). Every other request is handed to pyfuse3's session loop through its
receiver hook. Without fanfs's patched pyfuse3 (no receiver) or when the threads cannot start,
pyfuse3 reads every request itself: slower writes, the same file system.

Concurrency: start, stop and statistics run in the main thread (start and stop outside trio,
stop also from trio at the unmount); the C threads keep their own state (front.c).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanfs import native
from fanfs.native import lib
from fanfs.node.staging import PREFIX, pid_alive

log = logging.getLogger(__name__)

# One thread, and no polling of the device after a request (spin 0): polling did not help
# writes.
THREADS = 1
SPIN_US = 0

KEPT_WRITES = "writes"  # the buffers' file while the threads run (writes.c, "Kept")
SHM = "/dev/shm"
# Where in that file the staging directory's path goes (the header's part the C leaves to
# its owner), so that `sweep` can tell a file no recovery can use any more; at most this long:
PATH_AT, PATH_MAX = lib.WB_OWNER, lib.WB_HEAD - lib.WB_OWNER


def kept_places(staging_fd: int, staging: Path) -> list[tuple[str, int | None]]:
    """Where the buffers' file of the daemon whose staging directory is `staging` (open at
    `staging_fd`) goes, in the order tried, each as a name and the directory fd it is relative
    to: /dev/shm, a tmpfs on Linux, then the staging directory. Mapped from a file on a disk,
    the buffers cost a 1 GiB dd a fifth of its rate, from a tmpfs nothing measurable
    (docs/performance.md; likely the disk's writeback of the mapped pages, which a tmpfs does
    not have). Its name is the staging directory's, so the recovery finds it; only a file of
    this user's with mode 0600 is read back (recover.py)."""
    shm = os.path.join(SHM, f"fanfs-{os.geteuid()}-{staging.name}-{KEPT_WRITES}")
    return [(shm, None), (KEPT_WRITES, staging_fd)]


def sweep(shm: str = SHM) -> None:
    """Remove this user's buffers' files in `shm` whose daemon is gone (the pid in the name)
    and whose staging directory is gone too: no recovery can use them, and each holds 9 MiB of
    memory (a job's end that wiped the node's disk after a SIGKILL). Gone means: its parent
    (whose device and inode the file holds, with the path) is there, the same directory, and
    has no such entry. So a file of another mount namespace (a per-job /tmp), of a --local
    not mounted now, or one unreadable stays."""
    prefix = f"fanfs-{os.geteuid()}-{PREFIX}"
    try:
        names = [n for n in os.listdir(shm) if n.startswith(prefix) and n.endswith(KEPT_WRITES)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and _gone(os.path.join(shm, name)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm, name))
                log.info("removed %s: its daemon and its staging directory are gone", name)


def open_kept(name: str, at: int | None = None) -> tuple[int, os.stat_result]:
    """A buffers' file, open for reading, and its stat: only a regular file of this user's
    alone, never through a link, never waiting on a FIFO someone planted under its name in
    /dev/shm (ValueError: not one; OSError)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=at)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise ValueError("not a private file of this user")
    return fd, st


def _gone(path: str) -> bool:
    try:
        fd, _ = open_kept(path)
        try:
            dev, ino, where = os.pread(fd, PATH_MAX, PATH_AT).split(b"\0", 1)[0].split(b" ", 2)
        finally:
            os.close(fd)
        parent = os.stat(os.path.dirname(where), follow_symlinks=False)
        if (parent.st_dev, parent.st_ino) != (int(dev), int(ino)) or not where.startswith(b"/"):
            return False
    except (OSError, ValueError):
        return False
    try:
        os.lstat(where)
    except FileNotFoundError:
        return True  # (only this: a lookup that fails otherwise says nothing)
    except OSError:
        pass
    return False


def _staging_line(staging: Path) -> bytes:
    """What `sweep` reads: the staging directory's parent's device and inode, and its path."""
    where = os.path.abspath(staging)
    parent = os.stat(os.path.dirname(where))
    return f"{parent.st_dev} {parent.st_ino} ".encode() + os.fsencode(where)


# pyfuse3's receiver hook (node/fuse_ops.RECEIVER): install(receiver, fd) hands it the front's
# receiver (None: removes it), session_fd() is the FUSE session's fd.
Receiver = tuple[Callable[[Any, int], None], Callable[[], int]]


@dataclass(frozen=True, slots=True)
class FrontInfo:
    """Whether the front answers WRITEs in C, the kernel's FUSE protocol, why not (""), the
    bytes it wrote, and where its buffers' file is (a path, `writes` in the staging directory,
    or "")."""

    running: bool
    protocol: str  # the kernel's FUSE protocol, "7.N" ("" before its INIT)
    off: str
    written: int
    kept: str

    def to_json(self) -> dict[str, Any]:
        return {"running": self.running, "protocol": self.protocol, "off": self.off,
                "written": self.written, "kept": self.kept}  # fmt: skip


class WriteFront:
    """The front of one output mount; `receiver`: pyfuse3's hook, None without it."""

    def __init__(self, receiver: Receiver | None, places: list[tuple[str, int | None]],
                 staging: Path, pretend: int = 0):  # fmt: skip
        self.receiver = receiver
        self.places = places  # where the buffers' file may go (kept_places)
        self.staging = staging  # written into it, for `sweep`
        self.kept: tuple[str, int | None] | None = None  # where it went
        self.pretend = pretend  # the protocol minor to rewrite INIT to (Switches; 0: none)
        self.running = False  # its threads answer WRITEs now
        self.started = False  # they did since the mount: what they wrote is collected (view.py)
        self.native: lib.Front | None = None  # this wing's own C front, once made (start)

    def start(self, stack: contextlib.ExitStack) -> bool:
        """Let the threads answer WRITEs (after the mount); False (and a warning) if they
        cannot: pyfuse3 then reads every request itself."""
        if self.receiver is None:
            return False
        install, session_fd = self.receiver
        front = lib.Front(writes=True)
        why: OSError | None = None
        for place in self.places:
            try:
                front.pretend(self.pretend)
                ready = self._start_kept(front, place, session_fd())
                break
            except OSError as e:  # no such place, or no room there for the buffers
                why = e
        else:
            log.warning("front threads unavailable, writes go through the event loop: %s", why)
            return False
        self.native = front
        stack.callback(self._end, front)  # after trio is done with the receiver's fd
        install(front.receiver(), ready)
        self.running = self.started = True
        return True

    def stop(self) -> None:
        """Before the unmount: pyfuse3 reads the device again, the threads stop."""
        if self.running and self.receiver is not None:
            self.running = False
            self.receiver[0](None, -1)
            self._c().stop()  # every WRITE it answered is in its file now
            self._unlink()

    def _start_kept(self, front: lib.Front, place: tuple[str, int | None], fd: int) -> int:
        name, at = place
        kept = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600, dir_fd=at)  # fmt: skip
        self.kept = place
        try:
            front.keep_writes(kept)
            ready = front.start(fd, THREADS, SPIN_US)
            with contextlib.suppress(OSError):  # (never swept then: its recovery removes it)
                line = _staging_line(self.staging)
                if len(line) < PATH_MAX:
                    os.pwrite(kept, line, PATH_AT)
            return ready
        except OSError:
            self._unlink()
            raise
        finally:
            os.close(kept)  # mapped by now, or not needed

    def _end(self, front: lib.Front) -> None:
        """At the daemon's end, whichever way it came: the threads stopped (what is queued
        goes into its files; nothing if `stop` ran), the receiver's fd closed, the file gone."""
        front.stop()
        front.close()
        self._unlink()

    def _unlink(self) -> None:
        if self.kept is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.kept[0], dir_fd=self.kept[1])
            self.kept = None

    def statistics(self) -> FrontInfo:
        protocol, why = native.front_kernel(self.native)
        if self.receiver is None:
            why = "pyfuse3 is not fanfs's patched build (run `make setup`)"
        elif not self.running and not why:
            why = "its threads could not start"
        kept = self.kept[0] if self.kept is not None else ""
        return FrontInfo(self.running, protocol, why, self.written(), kept)

    def written(self) -> int:
        """Bytes the front wrote (the C counts them)."""
        return int(self.native.written()) if self.native is not None else 0

    # What the view asks of the threads once they started (files.py): which WRITEs of a
    # handle come to Python (`hold`), what they wrote and the errors they met through it.

    def _c(self) -> lib.Front:
        assert self.native is not None, "the front never started"
        return self.native

    def hold(self, fh: int, below: int) -> None:
        self._c().hold(fh, below)

    def settle(self) -> None:
        self._c().settle()

    def take_written(self, fh: int) -> int | None:
        return self._c().take_written(fh)

    def take_error(self, fh: int) -> int:
        return self._c().take_error(fh)
