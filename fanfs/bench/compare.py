"""The oracle: a tree read through a mount must equal its source, entry by entry, byte by byte.

Used by the tests and by tools/read_check.py (the sample training command of the Slurm job).
"""

from __future__ import annotations

import os
import stat

CHUNK = 8 << 20


def snapshot(root: bytes) -> dict[bytes, tuple[int, int, int, bytes | None]]:
    """relative path -> (mode, size, mtime_ns, symlink target) for every entry under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, target)
    return out


def same_bytes(a: bytes, b: bytes) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            ca, cb = fa.read(CHUNK), fb.read(CHUNK)
            if ca != cb:
                return False
            if not ca:
                return True


def assert_same_tree(src: os.PathLike[str] | str, mnt: os.PathLike[str] | str) -> int:
    """Assert equal attributes and contents; return the number of regular files compared."""
    s, m = os.fsencode(src), os.fsencode(mnt)
    want, got = snapshot(s), snapshot(m)
    assert sorted(got) == sorted(want)
    for rel, attrs in want.items():
        assert got[rel] == attrs, rel
    files = [rel for rel, (mode, *_) in want.items() if stat.S_ISREG(mode)]
    for rel in files:
        assert same_bytes(os.path.join(s, rel), os.path.join(m, rel)), rel
    return len(files)
