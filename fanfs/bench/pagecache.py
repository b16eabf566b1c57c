"""How the kernel holds a file in its page cache: the mean size of the folios of its pages.

A warm read is a copy out of the page cache, and its speed depends on the folio size: the
kernel copies folio by folio, so 4 KiB folios cost several times more per byte than 2 MiB ones.
Linux 6.18 keeps a FUSE file's page cache in 4 KiB folios, while ext4 (since 6.16) uses folios
up to 2 MiB for data written or read ahead in large pieces; with those, native warm reads run up
to 3x faster than the mount's (docs/performance.md, "Warm reads"). `fanfs bench` reports both
sides' mean folio size next to every ratio, so that a warm ratio can be read for what it is.

Reading frame numbers needs root: /proc/self/pagemap shows them only to CAP_SYS_ADMIN and
/proc/kpageflags is root-only. Without them the answer is None, never a guess.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
PM_PRESENT = np.uint64(1 << 63)
PM_PFN_MASK = np.uint64((1 << 55) - 1)
KPF_COMPOUND_TAIL = 1 << 16


def folio_kib(paths: list[str] | list[Path]) -> float | None:
    """Mean size in KiB of the folios holding the files' cached pages, None if unreadable."""
    counts = [c for p in paths if (c := folios(p)) is not None]
    if not counts:
        return None
    return sum(pages for pages, _ in counts) * PAGE / 1024 / sum(n for _, n in counts)


def folios(path: str | Path) -> tuple[int, int] | None:
    """(pages, folios) of the cached pages of `path`, or None if that cannot be read.

    Maps the file and touches every page, which maps the cached page (or reads it in: call
    this on files that are already cached), then looks up each page's frame and its flags:
    every page that is not the tail of a compound page starts a folio.
    """
    try:
        with (
            open(path, "rb") as f,
            open("/proc/self/pagemap", "rb") as pagemap,
            open("/proc/kpageflags", "rb") as kpageflags,
        ):
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return None
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                pages = np.frombuffer(m, dtype=np.uint8)
                int(pages[::PAGE].sum())  # touch each page so that it is mapped
                first = pages.ctypes.data // PAGE
                n = (size + PAGE - 1) // PAGE
                entries = np.frombuffer(os.pread(pagemap.fileno(), 8 * n, 8 * first), np.uint64)
                del pages  # the mmap cannot close while a view of it exists
            present = entries[(entries & PM_PRESENT) != 0]
            pfns = present & PM_PFN_MASK
            if len(pfns) == 0 or not pfns.all():
                return None  # frame numbers hidden: not root
            tails = 0
            for pfn in pfns.tolist():
                flags = int.from_bytes(os.pread(kpageflags.fileno(), 8, 8 * pfn), "little")
                tails += bool(flags & KPF_COMPOUND_TAIL)
    except (OSError, ValueError):
        return None
    return len(pfns), len(pfns) - tails
