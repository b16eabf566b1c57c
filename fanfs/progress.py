"""Progress for long steps: a redrawn bar on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

BAR_WIDTH = 30
TTY_REFRESH_S = 0.1  # a terminal redraw costs little; ten a second looks smooth
LOG_INTERVAL_S = 10.0  # batch logs (Slurm output files) get one line per interval


def parse_size(text: str) -> int:
    """`60G`, `512M`, `1.5T`, `4096` (binary units, optional `B`/`iB`) -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    def __init__(
        self, label: str, total_items: int, total_bytes: int, stream: TextIO | None = None
    ):
        self.label = label
        self.total_items = total_items
        self.total_bytes = total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        # -q (logging above INFO) silences progress too; the summary line still prints.
        self.quiet = logging.getLogger().getEffectiveLevel() > logging.INFO
        self.items = 0
        self.bytes = 0
        self.start = time.monotonic()
        self._last = self.start

    def update(self, items: int, nbytes: int) -> None:
        self.items += items
        self.bytes += nbytes
        now = time.monotonic()
        if self.quiet:
            return
        if now - self._last >= (TTY_REFRESH_S if self.tty else LOG_INTERVAL_S):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
        rate = self.bytes / max(now - self.start, 1e-9) / 1e6
        text = (
            f"{self.label}: {self.items}/{self.total_items} files, "
            f"{human_bytes(self.bytes)}/{human_bytes(self.total_bytes)}, {rate:.0f} MB/s"
        )
        if self.tty:
            filled = int(frac * BAR_WIDTH)
            bar = "#" * filled + "-" * (BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {frac:4.0%} {text}\x1b[K")
        else:
            self.stream.write(f"{text} ({frac:.0%})\n")
        self.stream.flush()

    def close(self) -> float:
        """Finish the bar; return the elapsed seconds."""
        elapsed = time.monotonic() - self.start
        if self.tty and not self.quiet:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        return elapsed
