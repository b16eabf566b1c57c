"""Reaching a mount's daemon from a command: its status, with a deadline, as its owner.

Shared by the dataset mount's commands (cli/mount.py) and the output mount's (cli/output.py).
"""

from __future__ import annotations

from typing import Any

from fanfs import mounts
from fanfs.errors import MountpointError

PROBE_TIMEOUT_S = 2.0  # a daemon that cannot answer a getxattr in 2 s is treated as hung


def ask(
    entry: mounts.MountEntry, timeout: float = PROBE_TIMEOUT_S, xattr: str = mounts.STATUS_XATTR
) -> dict[str, Any] | None:
    """The daemon's status, None if it does not answer in time; MountpointError for another
    user's mount (root asks as its owner). `xattr` mounts.RETRY_XATTR also has an output
    mount's daemon retry landing at once."""
    try:
        return mounts.probe_status(entry.mountpoint, timeout, as_uid=entry.user_id, xattr=xattr)
    except mounts.NotYours:
        raise MountpointError(
            f"{entry.mountpoint}: another user's fanfs mount (uid {entry.user_id}): only that "
            "user, or root, can reach its daemon"
        ) from None
