"""fanfs's C extension (fanfs/_native.pyx over fanfs/csrc/), loaded and checked once.

Every module that uses the native read path imports it from here, never `fanfs._native`
directly: a build of another API version (a stale `.so` after a pull without `make setup`)
is refused with what to run, instead of being half used. Built by the project's own install
(`pip install -e .`, setup.py); nothing else in fanfs is compiled.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

API_VERSION = 18  # fanfs/csrc/fanfs_native.h's FANFS_NATIVE_API that this Python expects

try:
    from fanfs import _native as lib
except ImportError as e:  # pragma: no cover - a broken install
    raise ImportError(
        f"fanfs's C extension cannot be loaded ({e}): run `make setup` (or `pip install -e .`)"
    ) from e

if lib.API_VERSION != API_VERSION:  # pragma: no cover - a stale build
    raise ImportError(
        f"fanfs's C extension speaks API {lib.API_VERSION}, this fanfs {API_VERSION}: rebuild it "
        "with `make setup` (or `pip install -e .`)"
    )

CorruptPiece = lib.CorruptPiece
Dictionaries = lib.Dictionaries
crc32 = lib.crc32
decode = lib.decode
read = lib.read
read_stored = lib.read_stored
failure_reason = lib.failure_reason
CRC_LIBRARY: str = lib.CRC_LIBRARY
DECODES: bool = lib.DECODES  # libzstd was found: compressed pieces decode in C


def front_kernel(front: lib.Front | None) -> tuple[str, str]:
    """(the kernel's FUSE protocol as `front` heard it, "7.N", "" before its INIT or without a
    front; why the front does not answer requests, in one line, "" when it does)."""
    if front is None:
        return "", ""
    k = front.kernel()
    protocol = f"{k['major']}.{k['minor']}" if k["major"] else ""
    why = {
        "": "",
        "protocol": f"the kernel's FUSE protocol {protocol} is not 7.12 or later: pyfuse3 "
        "answers every request",
        "buffer": f"the kernel refused {k['bufsize']}-byte reads of the FUSE device (a max_write "
        "above libfuse's 256 pages): the session ended",
    }[k["why"]]
    return protocol, why


def log_front(protocol: str, off: str, answers: str) -> None:
    """One line, once the kernel's INIT is answered: its protocol, and whether the front
    answers `answers` ("requests", "WRITEs") in C or, `off`, why not (what every figure in
    docs/performance.md assumes). The same line for both daemons."""
    if off:
        log.warning("kernel FUSE %s; the front is off, every %s goes through Python: %s",
                    protocol or "(no INIT yet)", answers.rstrip("s"), off)  # fmt: skip
    elif not protocol:
        log.info("no FUSE INIT within a second: the front answers %s in C once it comes", answers)
    else:
        log.info("kernel FUSE %s; the front answers %s in C", protocol, answers)


__all__ = ["API_VERSION", "CRC_LIBRARY", "DECODES", "CorruptPiece",
           "Dictionaries", "crc32", "decode", "failure_reason", "front_kernel", "lib", "log_front",
           "read", "read_stored"]  # fmt: skip
