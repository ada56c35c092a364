"""Rate-limited warnings: the first failure of a kind is logged as it happens, the rest of
an interval as one summary line with a count.

A tier that fails every write (an unwritable directory, a server that went away) would
otherwise log one line per block: thousands of lines a second that drown the one line that
says why. The summary keeps the count and the last error, so nothing is hidden.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

__all__ = ["WarningSummary"]


@dataclass(slots=True)
class _Window:
    started: float
    suppressed: int = 0
    last: str = ""
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class WarningSummary:
    """Log at most one line per ``(subject, op)`` per ``interval`` seconds, then a summary.

    Parameters
    ----------
    logger
        Where the lines go (at WARNING).
    interval
        Seconds a window lasts. The first failure of a window is logged in full; the others
        are counted and logged as one line when the window ends (a timer on the running
        loop, or the next failure after it, or :meth:`flush`).
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self.interval = interval
        self._windows: dict[tuple[str, str], _Window] = {}

    def warn(self, subject: str, op: str, message: str) -> None:
        """Report one failure of ``op`` on ``subject`` (``message``: what went wrong)."""
        now = time.monotonic()
        window = self._windows.get((subject, op))
        if window is not None and now - window.started >= self.interval:
            self._summarise((subject, op))
            window = None
        if window is None:
            self._windows[(subject, op)] = _Window(started=now)
            self._log.warning("%s failed %s: %s", subject, op, message)
            return
        window.suppressed += 1
        window.last = message
        if window.timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: the next failure or flush() reports it
                return
            window.timer = loop.call_at(loop.time() + self.interval - (now - window.started),
                                        self._summarise, (subject, op))

    def _summarise(self, which: tuple[str, str]) -> None:
        window = self._windows.pop(which, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if window.suppressed:
            subject, op = which
            self._log.warning("%s failed %s %d more time(s) in the last %.0f s (last: %s)",
                              subject, op, window.suppressed,
                              time.monotonic() - window.started, window.last)

    def flush(self) -> None:
        """Log every pending summary now (at close) and cancel the timers."""
        for which in list(self._windows):
            self._summarise(which)
