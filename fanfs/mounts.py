"""The kernel's mount table, read without touching the mount points themselves.

A stat() on a FUSE mount whose daemon hangs would hang too, so checks that must never hang
(`wait`, `umount`, "already mounted?") read /proc/self/mountinfo instead, and the one call that
does enter a mount (the status probe) runs in a thread with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FSTYPE = "fuse.fanfs"
OUTPUT_FSTYPE = "fuse.fanfs-output"  # `fanfs output`: a writable view landing on DEST
STATUS_XATTR = "user.fanfs.status"
RETRY_XATTR = "user.fanfs.retry"  # output mounts: land everything now, then the status
SKIP_XATTR = "user.fanfs.skip"  # output mounts: + ".SEQ": skip change SEQ, failing (`sync --skip`)
OUTPUT_SOURCE = "fanfs-output"  # an output mount's source: "fanfs-output:<staging directory>"
_OCTAL = re.compile(r"\\([0-7]{3})")


SYMLINKS_MAX = 40  # as the kernel's path walk (ELOOP)


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    fstype: str
    device: str  # "major:minor": also the name of the mount's bdi under /sys/class/bdi
    user_id: int | None = None  # a FUSE mount's owner (its super options' user_id=)
    source: str = ""  # what the file system says it mounted (an output mount: its staging)


def canonical(path: Path | str) -> str:
    """Absolute path with every symlink resolved, the last part too, without stat-ing it: a
    stat of a hung mount would hang (readlink of a mount point answers EINVAL without asking
    its daemon: the kernel holds the root of a mount)."""
    p = Path(os.path.abspath(path))
    for _ in range(SYMLINKS_MAX):
        if not p.name:
            return str(p)
        p = p.parent.resolve() / p.name
        try:
            target = os.readlink(p)
        except OSError:  # not a symlink (EINVAL), or nothing there
            return str(p)
        p = Path(os.path.abspath(p.parent / target))
    return str(p)


def _entries() -> Iterator[tuple[str, list[str]]]:
    """(mount point, fields) of every line of /proc/self/mountinfo."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            yield _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4]), fields


def under(path: Path | str) -> list[str]:
    """Mount points at or below `path`."""
    root = canonical(path)
    return [m for m, _ in _entries() if m == root or m.startswith(root.rstrip("/") + "/")]


def find(path: Path | str) -> MountEntry | None:
    """The topmost mount at `path`, or None."""
    want = canonical(path)
    found = None
    for mountpoint, fields in _entries():
        if mountpoint == want:
            sep = fields.index("-")
            source = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[sep + 2])
            found = MountEntry(mountpoint, fields[sep + 1], fields[2], _user_id(fields[-1]),
                               source)  # fmt: skip
    return found


def _user_id(superopts: str) -> int | None:
    for opt in superopts.split(","):
        if opt.startswith("user_id="):
            with contextlib.suppress(ValueError):
                return int(opt[len("user_id=") :])
    return None


FUSECTL = Path("/sys/fs/fuse/connections")


def connection(entry: MountEntry) -> Path:
    """The fuse control file system's directory of a FUSE mount's connection (abort, waiting,
    max_background, congestion_threshold)."""
    return FUSECTL / entry.device.rpartition(":")[2]


def abort_connection(entry: MountEntry) -> bool:
    """Abort the FUSE connection behind a mount: every request waiting on its daemon fails at
    once (ENOTCONN) instead of waiting for a daemon that is stopped, stuck in the kernel or
    gone, and the daemon's own calls into the kernel end. Through the fuse control file system
    (`/sys/fs/fuse/connections/N/abort`, writable by the user who mounted); False when it is
    not mounted there or the write fails."""
    try:
        (connection(entry) / "abort").write_text("1\n")
        return True
    except OSError:
        return False


class NotYours(Exception):
    """The mount belongs to another user: the kernel refuses us its files (FUSE without
    allow_other admits only the user who mounted, root included)."""


def probe_status(
    path: Path | str, timeout: float, as_uid: int | None = None, xattr: str = STATUS_XATTR
) -> dict[str, Any] | None:
    """The daemon's status (the hidden xattr), or None if it does not answer within `timeout`.
    NotYours if the kernel refuses us (another user's mount). Root asks as `as_uid` (the
    mount's owner): in a child process that takes that user's identity, so that root's
    `status` and `umount` reach a user's daemon instead of taking it for a hung one."""
    if as_uid is not None and as_uid != os.geteuid() and os.geteuid() == 0:
        return _probe_as(path, timeout, as_uid, xattr)
    result: list[Any] = []

    def ask() -> None:
        try:
            result.append(json.loads(os.getxattr(path, xattr)))
        except PermissionError as e:
            result.append(e)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=ask, name="fanfs-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if result and isinstance(result[0], PermissionError):
        raise NotYours(str(path))
    return result[0] if result else None


def _probe_as(path: Path | str, timeout: float, uid: int, xattr: str) -> dict[str, Any] | None:
    import pwd

    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = uid
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: this user's identity, one getxattr, the answer down the pipe
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.write(wfd, os.getxattr(path, xattr))
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    got = b""
    try:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([rfd], [], [], left)[0]:
                return None
            chunk = os.read(rfd, 1 << 16)
            if not chunk:
                break
            got += chunk
        return json.loads(got) if got else None
    except ValueError:
        return None
    finally:
        os.close(rfd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)  # a child stuck in a hung mount: it is ours to end
        os.waitpid(pid, 0)


def users(path: Path | str, skip: int = 0) -> list[tuple[int, str]]:
    """(pid, command) of the processes we can see that use something under the mount at
    `path`: an open file, a mapped file, their working or root directory. Only the mount's
    owner (and root) can use a FUSE mount, so a user sees every process that could."""
    root = canonical(path)
    inside = root.rstrip("/") + "/"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (skip, os.getpid()):
            continue
        proc = f"/proc/{name}"
        links = [f"{proc}/cwd", f"{proc}/root"]
        with contextlib.suppress(OSError):
            links += [f"{proc}/fd/{fd}" for fd in os.listdir(f"{proc}/fd")]
        paths = []
        for link in links:
            with contextlib.suppress(OSError):
                paths.append(os.readlink(link))
        with contextlib.suppress(OSError), open(f"{proc}/maps", errors="replace") as maps:
            paths += [line.split(None, 5)[-1].rstrip("\n") for line in maps if "/" in line]
        if any(p == root or p.startswith(inside) for p in paths):
            comm = ""
            with contextlib.suppress(OSError), open(f"{proc}/comm") as f:
                comm = f.read().strip()
            found.append((int(name), comm))
    return found
