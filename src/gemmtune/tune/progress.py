"""Progress of a tuning run: a bar on a terminal, one plain line per shape otherwise (CI logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0
        self.failed = 0
        self.start = time.monotonic()

    def update(self, what: str, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        counts = f"{self.done}/{self.total}" + (f" ({self.failed} failed)" if self.failed else "")
        if self.tty:
            width = 30
            filled = int(width * self.done / max(1, self.total))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {counts} {elapsed:.0f}s "
                              f"eta {eta:.0f}s  {what[:60]:<60}")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"{self.label} {counts} {elapsed:.1f}s: {what}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line that must not be overwritten by the bar (a failure, a warning)."""
        self.stream.write(("\n" if self.tty else "") + text + "\n")
        self.stream.flush()
