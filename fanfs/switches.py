"""The FANFS_* switches the daemons obey (docs/commands.md, "Environment"), parsed once: the
CLI checks every value (cli/options.py, `check_environment`: a bad one is one line and exit 2)
and reads them into this record, which it hands to the daemon in its configuration; nothing
below the CLI reads the environment for them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "FANFS_"
SPIN_US = 500  # the default: see `Switches.spin_us`
START_TIMEOUT_S = 300  # the default: see `Switches.start_timeout_s`


@dataclass(frozen=True, slots=True)
class Switches:
    # Each is on unless its variable is 0 (for comparison, or should one ever be suspected).
    front: bool = True  # FANFS_FRONT=0: every request goes through pyfuse3's session loop
    native_decode: bool = True  # FANFS_NATIVE_DECODE=0: compressed files are left to Python
    native_remote: bool = True  # FANFS_NATIVE_REMOTE=0: the front's READs of peers' files too
    push: bool = True  # FANFS_PUSH=0: the pool pushes nothing it decoded into the page cache
    # FANFS_PLANE=0: peers' files and the answers to peers go through the MPI thread (Python)
    # instead of the data plane (fanfs/csrc/plane.c)
    plane: bool = True
    # FANFS_SPIN_US: how long after a request the front's leader polls for the next one before
    # it sleeps (0: never poll, for nodes where a core must never be busy).
    spin_us: int = SPIN_US
    # FANFS_PRETEND_PROTOCOL=7.N (tests only): the front rewrites the kernel's INIT to protocol
    # 7.N's layout and flags, so this kernel talks to the daemon as an older one would
    # (tests/adapter/test_kernels.py); 0: as sent.
    pretend_protocol: int = 0
    # FANFS_BACKGROUND: how many READs the kernel may keep outstanding in the background (its
    # readahead; it stops async readahead at 3/4 of it); None: sized to the node (the
    # daemon's BACKGROUND); 0: the kernel's own (12).
    background: int | None = None
    # FANFS_START_TIMEOUT: how many seconds a daemon's start-up collective waits for the other
    # ranks (one died or never started) before the daemon fails with one line; the job
    # template waits as long for every node to serve.
    start_timeout_s: int = START_TIMEOUT_S

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Switches:
        """The switches `environ` sets, its values already checked (cli/options.py)."""

        def value(name: str) -> str:
            return environ.get(PREFIX + name, "").strip()

        spin, pretend, background = value("SPIN_US"), value("PRETEND_PROTOCOL"), value("BACKGROUND")
        start = value("START_TIMEOUT")
        return cls(
            front=value("FRONT") != "0",
            native_decode=value("NATIVE_DECODE") != "0",
            native_remote=value("NATIVE_REMOTE") != "0",
            push=value("PUSH") != "0",
            plane=value("PLANE") != "0",
            spin_us=int(spin) if spin else SPIN_US,
            pretend_protocol=int(pretend.partition(".")[2]) if pretend else 0,
            background=int(background) if background else None,
            start_timeout_s=int(start) if start else START_TIMEOUT_S,
        )
