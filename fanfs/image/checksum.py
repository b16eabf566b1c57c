"""CRC-32 (zlib's polynomial, the one every image stores), as fast as this machine computes it.

From fanfs's C extension (fanfs/native.py): ISA-L's (Debian's libisal2, which
tools/setup_system.sh installs; C with SIMD) runs about 12 times faster than zlib's here: 2.7
against 33 us for a 128 KiB file, a cost every remote fetch and every inline read of a small
file pays. zlib's is the fallback where libisal2 is missing; both give the same values. The
native read pool uses the same function.

Concurrency: a pure function; it releases the GIL on buffers of 64 KiB and more.
"""

from __future__ import annotations

from fanfs.native import CRC_LIBRARY, crc32

IMPLEMENTATION = CRC_LIBRARY  # "isa-l" or "zlib"
__all__ = ["IMPLEMENTATION", "crc32"]
