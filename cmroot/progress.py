"""Progress on stderr for long commands: a line redrawn in place on a terminal, a line
every few seconds in a log (journald, CI)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress counter on stderr; silent when stderr is not a terminal
    unless the work is long, then a line every few seconds."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = time.monotonic()

    def __call__(self, done: int, total: int | None = None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        final = total is not None and done >= total
        if not final and now - self._last < (0.2 if self.tty else 5.0):
            return
        self._last = now
        text = f"{self.label}: {done}" + (f"/{total}" if total else "")
        if self.tty:
            sys.stderr.write("\r" + text + ("\n" if final else ""))
        elif not final or done > 1000:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
