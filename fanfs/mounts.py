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
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FSTYPE = "fuse.fanfs"
STATUS_XATTR = "user.fanfs.status"
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    fstype: str
    device: str  # "major:minor": also the name of the mount's bdi under /sys/class/bdi


def canonical(path: Path | str) -> str:
    """Absolute path with the parent resolved, without stat-ing the (maybe hung) last part."""
    p = Path(os.path.abspath(path))
    return str(p.parent.resolve() / p.name) if p.name else str(p)


def find(path: Path | str) -> MountEntry | None:
    """The topmost mount at `path`, or None."""
    want = canonical(path)
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            mountpoint = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
            if mountpoint == want:
                sep = fields.index("-")
                found = MountEntry(mountpoint, fields[sep + 1], fields[2])
    return found


FUSECTL = Path("/sys/fs/fuse/connections")


def abort_connection(entry: MountEntry) -> bool:
    """Abort the FUSE connection behind a mount: every request waiting on its daemon fails at
    once (ENOTCONN) instead of waiting for a daemon that is stopped, stuck in the kernel or
    gone, and the daemon's own calls into the kernel end. Through the fuse control file system
    (`/sys/fs/fuse/connections/N/abort`, writable by the user who mounted); False when it is
    not mounted there or the write fails."""
    minor = entry.device.rpartition(":")[2]
    try:
        (FUSECTL / minor / "abort").write_text("1\n")
        return True
    except OSError:
        return False


def probe_status(path: Path | str, timeout: float) -> dict[str, Any] | None:
    """The daemon's status (the hidden xattr), or None if it does not answer within `timeout`."""
    result: list[dict[str, Any]] = []

    def ask() -> None:
        with contextlib.suppress(OSError, ValueError):
            result.append(json.loads(os.getxattr(path, STATUS_XATTR)))

    thread = threading.Thread(target=ask, name="fanfs-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else None
