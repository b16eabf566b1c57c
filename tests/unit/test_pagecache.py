"""Unit tier: fanfs.bench.pagecache, how many folios hold a cached file's pages (what `fanfs bench`
reports beside each side's speed)."""

from __future__ import annotations

import os
from pathlib import Path

from fanfs.bench import pagecache


def test_folio_sizes_of_cached_files(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    assert f.read_bytes() == data  # cached
    pages, folios = pagecache.folios(f) or (0, 0)
    assert pages == 256 and 1 <= folios <= 256
    assert pagecache.folio_kib([f, f]) == 1024 / folios
    assert pagecache.folios(tmp_path / "missing") is None
    (tmp_path / "empty").write_bytes(b"")
    assert pagecache.folio_kib([tmp_path / "empty"]) is None
