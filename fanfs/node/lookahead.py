"""Fetches started at LOOKUP: a remote file's bytes on their way before the kernel asks for them.

With `no_open`, the first request the kernel sends for a file whose dentry it does not hold is
its LOOKUP; the READ follows once the reader's `open()` and `read()` reach the kernel. For a
small file held by a peer the reader starts the whole-file fetch at the LOOKUP, so the READ
joins a fetch already under way (or finds the bytes arrived) instead of starting its own.

A LOOKUP is not always followed by a READ: `ls -l`, `find -size` and `du` look files up without
reading them, and fetching each would pull a dataset over the network for nothing. So
`LookAhead` keeps the last WINDOW remote lookups and notes which of them were read. Fetching
at LOOKUP stays on while most are (an exponential average of that share of at least ON_SHARE,
one step of DECAY per lookup that leaves the window, read or not). The share is measured
whether or not fetches were started, so fetching comes back on once reads follow lookups
again. A stat-only walk costs at most about WINDOW + 7 fetches before it stops; fetched bytes
wait in the reader's bounded cache until their READ takes them.

Concurrency: the trio thread only.
"""

from __future__ import annotations

from collections import OrderedDict

WINDOW = 64  # lookups remembered: far more than the readers that can be between LOOKUP and READ
DECAY = 0.1
ON_SHARE = 0.5
SIZE_LIMIT = 4 << 20  # stored bytes of a file fetched whole at its LOOKUP, at most


class LookAhead:
    def __init__(self) -> None:
        self._recent: OrderedDict[int, bool] = OrderedDict()  # entry -> fetched at LOOKUP
        self._share = 1.0  # averaged share of remote lookups followed by a read
        self.fetched = 0
        self.used = 0  # fetched at LOOKUP, then read
        self.unused = 0  # fetched at LOOKUP, not read while in the window

    @property
    def on(self) -> bool:
        return self._share >= ON_SHARE

    def looked_up(self, entry: int, fetching: bool) -> None:
        """The kernel looked up remote file `entry`; `fetching`: its fetch starts now."""
        self._recent.pop(entry, None)
        self._recent[entry] = fetching
        self.fetched += fetching
        while len(self._recent) > WINDOW:
            _, fetched = self._recent.popitem(last=False)
            self._outcome(False, fetched)

    def waiting(self, entry: int) -> bool:
        """Whether `entry` was looked up and its READ has not come yet."""
        return entry in self._recent

    def read(self, entry: int) -> bool:
        """The kernel reads `entry`: True if its fetch started at its LOOKUP."""
        fetched = self._recent.pop(entry, None)
        if fetched is None:
            return False
        self._outcome(True, fetched)
        return fetched

    def _outcome(self, read: bool, fetched: bool) -> None:
        self._share += DECAY * (read - self._share)
        if fetched:
            self.used += read
            self.unused += not read
