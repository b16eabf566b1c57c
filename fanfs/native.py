"""fanfs's C extension (fanfs/_native.pyx over fanfs/csrc/), loaded and checked once.

Every module that uses the native read path imports it from here, never `fanfs._native`
directly: a build of another API version (a stale `.so` after a pull without `make setup`)
is refused with what to run, instead of being half used. Built by the project's own install
(`pip install -e .`, setup.py); nothing else in fanfs is compiled.
"""

from __future__ import annotations

API_VERSION = 9  # fanfs/csrc/fanfs_native.h's FANFS_NATIVE_API that this Python expects

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

__all__ = ["API_VERSION", "CRC_LIBRARY", "DECODES", "CorruptPiece", "Dictionaries", "crc32",
           "decode", "failure_reason", "lib", "read", "read_stored"]  # fmt: skip
