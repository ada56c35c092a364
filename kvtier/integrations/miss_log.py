"""A connector's prefix lookups, summarised in one log line per interval (never per block).

An engine connector calls :meth:`MissLog.lookup` once per lookup; at most once per
``interval_s`` the log gets how many blocks were asked and found, and why the lookups that
fell short did: the store's ``lookup_miss_reasons`` since the last line (``not_stored``,
``evicted``, ``corrupt``, ``unavailable``, ``deadline``), plus the connector's own
(``below_threshold``: the prompt is shorter than a block plus one token; ``unavailable``: the
lookup itself failed). An interval in which lookups found nothing at all is logged as a
WARNING (the "hit rate 0" case), any other as INFO. ``kvtier explain`` and
``docs/troubleshooting.md`` take it from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.misses import MissReason

__all__ = ["DEFAULT_INTERVAL_S", "LookupStore", "MissLog"]


class LookupStore(Protocol):
    """What a connector's scheduler side asks: a :class:`~kvtier.BlockingStore`, or the host
    daemon's socket (:class:`kvtier.integrations.vllm_local.LocalLookups`)."""

    def lookup_prefix(self, keys: Sequence[bytes], *, timeout: float | None = ...) -> int:
        """How many leading ``keys`` are stored."""

    def stats(self, *, timeout: float | None = ...) -> dict[str, Any]:
        """Figures, ``lookup_miss_reasons`` among them."""

    def close(self) -> None:
        """Release what it holds."""

#: Seconds between two summary lines.
DEFAULT_INTERVAL_S = 60.0
_STATS_TIMEOUT_S = 1.0


class MissLog:
    """Counts lookups and logs their misses by reason once per interval.

    Parameters
    ----------
    store
        The store the lookups ask (its ``lookup_miss_reasons`` give the store's reasons);
        ``None`` when the connector looks only in its own index (its misses are then
        ``not_stored``: no block this engine saved).
    logger
        Where the summary goes.
    interval_s
        Seconds between two lines (at most one per interval, only after a lookup).
    clock
        Monotonic seconds (tests pass a fake one).

    Notes
    -----
    Called from one thread (the scheduler's). A lookup costs a few integer additions; the
    store's counters are read once per line.
    """

    def __init__(self, store: LookupStore | None, logger: logging.Logger, *,
                 interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self._since = clock()
        self._store_seen: dict[str, int] = {}
        self._store_seen = self._store_reasons()
        self._reset()

    def _reset(self) -> None:
        self.lookups = self.asked = self.found = 0
        self.own: dict[str, int] = {}

    def lookup(self, asked: int, found: int, reason: MissReason | None = None) -> None:
        """One lookup: ``asked`` blocks, the first ``found`` of them held; ``reason``: why the
        connector itself did not ask (``below_threshold``)."""
        self.lookups += 1
        self.asked += asked
        self.found += found
        if reason is not None:
            self.note(reason)
        elif found < asked and self.store is None:
            self.note(MissReason.NOT_STORED)
        now = self.clock()
        if now - self._since >= self.interval_s:
            self.flush(now)

    def note(self, reason: MissReason) -> None:
        """A reason the connector saw itself (e.g. ``unavailable``: the lookup failed)."""
        self.own[str(reason)] = self.own.get(str(reason), 0) + 1

    def flush(self, now: float | None = None) -> None:
        """Log the summary of the lookups since the last line (if any) and start anew."""
        now = self.clock() if now is None else now
        seen = self._store_reasons()
        reasons = dict(self.own)
        for reason, n in seen.items():
            delta = n - self._store_seen.get(reason, 0)
            if delta > 0:
                reasons[reason] = reasons.get(reason, 0) + delta
        self._store_seen = seen
        if self.lookups:
            why = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or "none"
            share = f" ({100 * self.found / self.asked:.0f}%)" if self.asked else ""
            level = logging.WARNING if self.found == 0 and (self.asked or reasons) \
                else logging.INFO
            self.log.log(level, "kvtier lookups in the last %.0f s: %d lookups, %d of %d "
                         "blocks found%s; why lookups fell short: %s (kvtier explain tells "
                         "per block)", now - self._since, self.lookups, self.found,
                         self.asked, share, why)
        self._since = now
        self._reset()

    def _store_reasons(self) -> dict[str, int]:
        if self.store is None:
            return {}
        try:
            counts = self.store.stats(timeout=_STATS_TIMEOUT_S).get("lookup_miss_reasons")
        except Exception as exc:  # a stuck store must not stop the scheduler's lookups
            self.log.debug("kvtier miss summary: stats unavailable: %r", exc)
            return dict(self._store_seen)
        return dict(counts) if isinstance(counts, dict) else {}
