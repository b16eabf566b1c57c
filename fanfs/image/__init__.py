"""The prepared image: its format (format.py, docs/format.md), the catalog and its checks,
the codec and its array filters, checksums, the image directory, many paths to entries at
once, and `fanfs info`/`verify` (verify.py)."""
