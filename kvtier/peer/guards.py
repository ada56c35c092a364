"""Server resource guards: a byte budget for request bodies in flight, a connection cap
within the open-files limit, and a rate limit on accept-error logging.

A peer server is reachable by every member of the pool and, by mistake or malice, by more:
each guard turns one way of exhausting the process (memory for declared bodies, file
descriptors for idle connections, disk for error logs) into a refused request instead.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import cast

__all__ = ["FD_RESERVE", "SHARE_SECONDS", "AcceptErrorFilter", "BodyBudget", "RefuseProtocol",
           "connection_limit", "raise_open_files_limit"]

log = logging.getLogger("kvtier.peer.server")

#: While the in-flight budget is more than half held, a body must arrive at its share of
#: the budget's bandwidth: the whole budget turned over in this many seconds, so a body
#: holding ``n`` bytes of it needs ``n / SHARE_SECONDS`` bytes/s (64 MiB: 6.4 MiB/s).
SHARE_SECONDS = 10.0


class BodyBudget:
    """Bytes of request bodies (and batch answers) the server holds at once, server-wide.

    :meth:`try_take` reserves before anything is allocated; a request that does not fit is
    refused (``503`` with ``Retry-After``) rather than queued, so a burst of large declared
    bodies costs the senders a retry, not the server its memory.

    The last ``repair_reserve`` bytes are taken only by repair writes (read repair, hinted
    handoff and anti-entropy pushes: the ``?fill=1`` puts), so when clients fill the budget
    the copies that keep blocks at ``replicas`` are still admitted and clients are refused
    first.

    Parameters
    ----------
    limit
        Most bytes reserved at once.
    repair_reserve
        Bytes of ``limit`` only repair writes may take (``0 <= repair_reserve < limit``).
    """

    def __init__(self, limit: int, repair_reserve: int = 0) -> None:
        if limit < 1:
            raise ValueError(f"limit: expected >= 1, got {limit!r}")
        if not 0 <= repair_reserve < limit:
            raise ValueError(f"repair_reserve: expected 0 <= reserve < limit {limit}, "
                             f"got {repair_reserve!r}")
        self.limit = limit
        self.repair_reserve = repair_reserve
        self.held = 0
        self.refused = 0
        self.reserve_admissions = 0  # repair writes admitted past the client share

    def try_take(self, nbytes: int, *, repair: bool = False) -> bool:
        """Reserve ``nbytes`` (``repair``: a repair write, which may use the repair
        reserve); ``False`` (and counted) when that would pass its limit."""
        if not self.try_take_quietly(nbytes, repair=repair):
            self.refused += 1
            return False
        return True

    def try_take_quietly(self, nbytes: int, *, repair: bool = False) -> bool:
        """Reserve ``nbytes`` if they fit, without counting a refusal (for a caller that
        hands a request that does not fit to a path which refuses, and counts, it)."""
        client_limit = self.limit - self.repair_reserve
        if self.held + nbytes > (self.limit if repair else client_limit):
            return False
        if self.held + nbytes > client_limit:
            self.reserve_admissions += 1
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Return a reservation."""
        self.held = max(0, self.held - nbytes)

    def required_rate(self, nbytes: int, floor: float) -> float:
        """Bytes per second a body holding ``nbytes`` of the budget must arrive at now:
        ``floor`` (the server's ``min_body_rate``) while at most half the budget is held;
        past that, at least its share of the budget's bandwidth (:data:`SHARE_SECONDS`).

        Why: a floor alone lets a few large bodies that arrive just above it hold most of
        the budget for minutes (14 uploads of 64 MiB at 300 KiB/s held 896 of 1,024 MiB
        while everyone else got ``503``). Measured against the share each holds, the slow
        ones are cut off (``408``) once others need the room, and a body that keeps its
        share, or any body while the budget has room, is never affected. ``floor`` 0
        turns both off."""
        if not floor:
            return 0.0
        if self.held * 2 <= self.limit:
            return floor
        return max(floor, nbytes / SHARE_SECONDS)


class RefuseProtocol(asyncio.Protocol):
    """Answers ``503`` and closes: what a connection past the connection cap gets."""

    _ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
               b"Content-Length: 21\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
               b"too many connections\n")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports do not derive from asyncio's classes.
        cast(asyncio.WriteTransport, transport).write(self._ANSWER)
        transport.close()


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the new
    ``(soft, hard)``. A server at the common 1024 default runs out of descriptors long
    before memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # e.g. a hard limit the kernel caps lower
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, want, exc)
        return soft, hard
    return want, hard


# Descriptors never given to connections: the listener, the event loop's own, the segment's
# files (LMDB, file tiers), logs, and every connection past the cap while its 503 is written.
FD_RESERVE = 128


def connection_limit(max_connections: int, open_files: int) -> int:
    """``max_connections`` clamped to ``open_files`` (the soft ``RLIMIT_NOFILE``) less
    :data:`FD_RESERVE`: with descriptors left over, a connection past the cap is accepted
    and answered ``503``; with none, ``accept()`` fails and clients are reset or left
    hanging in the backlog."""
    if open_files == resource.RLIM_INFINITY or max_connections <= open_files - FD_RESERVE:
        return max_connections
    limit = max(1, open_files - FD_RESERVE)
    log.warning("max_connections %d clamped to %d: the open-files limit is %d (%d kept "
                "for other descriptors)", max_connections, limit, open_files, FD_RESERVE)
    return limit


class AcceptErrorFilter(logging.Filter):
    """Lets one accept-error record through per ``interval`` seconds and counts the rest.

    When descriptors run out, the event loop reports every failed ``accept()`` with a
    traceback; at thousands per second that fills a disk. Installed once per process on
    the ``asyncio`` logger (which asyncio and uvloop both report through).
    """

    def __init__(self, interval: float = 5.0) -> None:
        super().__init__()
        self.interval = interval
        self.suppressed = 0
        self.total_suppressed = 0
        self._last = -float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if "accept" not in message.lower():
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self.suppressed += 1
            self.total_suppressed += 1
            return False
        self._last = now
        if self.suppressed:
            record.msg = f"{message} ({self.suppressed} more suppressed since the last report)"
            self.suppressed = 0
        return True

    @classmethod
    def install(cls) -> AcceptErrorFilter:
        """The process's filter on the ``asyncio`` logger (added on first call)."""
        logger = logging.getLogger("asyncio")
        for existing in logger.filters:
            if isinstance(existing, cls):
                return existing
        added = cls()
        logger.addFilter(added)
        return added
