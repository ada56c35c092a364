"""A tiny progress bar on stderr (no dependency): redraws one line at most ~10 times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """A one-line progress bar.

    Parameters
    ----------
    total
        Units of work expected (``None`` or 0: show a running count only).
    label
        Text before the bar.
    stream
        Where to draw (default ``sys.stderr``).
    enabled
        ``None`` draws only when ``stream`` is a terminal, so logs and captured output stay
        clean; ``True``/``False`` force it.
    """

    def __init__(self, total: float | None, label: str = "", *, stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 30) -> None:
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total = total or 0.0
        self.label = label
        self.width = width
        self.done = 0.0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, n: float = 1.0, *, to: float | None = None, note: str = "") -> None:
        """Advance by ``n`` units (or set the position ``to``) and redraw if due."""
        self.done = to if to is not None else self.done + n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last_draw >= 0.1:
            self._last_draw = now
            self._draw(note)

    def _draw(self, note: str = "") -> None:
        elapsed = time.perf_counter() - self._start
        if self.total > 0:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            text = f"\r{self.label} [{bar}] {frac * 100:5.1f}% {elapsed:5.1f}s eta {eta:5.1f}s"
        else:
            text = f"\r{self.label} {self.done:,.0f} {elapsed:5.1f}s"
        self.stream.write(f"{text} {note}"[:120].ljust(80))
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
