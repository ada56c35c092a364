"""Counters the store keeps per tier and for itself, and a fixed-size latency histogram.

Everything here is plain integer arithmetic on the event-loop thread (no locks): recording a
sample costs one ``int.bit_length`` and one list increment, so the store can time every tier
call on its hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.misses import MissLedger
    from kvtier.tiers.base import Tier

__all__ = ["LatencyHistogram", "StoreCounters", "TierCounters"]

# Four sub-buckets per power of two: a bucket's midpoint is within ~12% of any sample in it,
# plenty to tell 3 us from 30 us, and the histogram never grows (64 * 4 ints).
_SUB_BITS = 2
_SUB = 1 << _SUB_BITS
_BUCKETS = 64 * _SUB


def _bucket(ns: int) -> int:
    if ns < _SUB:
        return max(ns, 0)
    top = ns.bit_length() - 1
    return (top - _SUB_BITS + 1) * _SUB + ((ns >> (top - _SUB_BITS)) & (_SUB - 1))


def _bucket_mid_ns(index: int) -> float:
    if index < _SUB:
        return float(index)
    octave, sub = divmod(index, _SUB)
    top = octave + _SUB_BITS - 1
    low = (1 << top) + (sub << (top - _SUB_BITS))
    width = 1 << (top - _SUB_BITS)
    return low + width / 2


class LatencyHistogram:
    """Log-bucketed latency histogram with constant memory.

    Samples are nanoseconds; :meth:`percentile` returns microseconds (bucket midpoint).
    """

    __slots__ = ("_counts", "count")

    def __init__(self) -> None:
        self._counts = [0] * _BUCKETS
        self.count = 0

    def record(self, ns: int) -> None:
        """Add one sample of ``ns`` nanoseconds."""
        self._counts[_bucket(ns)] += 1
        self.count += 1

    def percentile(self, q: float) -> float | None:
        """The ``q``-quantile (0..1) in microseconds, or ``None`` without samples."""
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for index, n in enumerate(self._counts):
            seen += n
            if seen > rank:
                return round(_bucket_mid_ns(index) / 1000.0, 2)
        return round(_bucket_mid_ns(_BUCKETS - 1) / 1000.0, 2)  # pragma: no cover


def _counts(counters: TierCounters | StoreCounters) -> dict[str, int]:
    """Every integer field of ``counters``, in declaration order (a new counter field shows
    up in the stats without a second edit)."""
    return {f.name: value for f in fields(counters)
            if isinstance(value := getattr(counters, f.name), int)}


@dataclass(slots=True)
class TierCounters:
    """What the store observed of one tier.

    ``promotions`` and ``demotions`` count blocks written *into* this tier from below and
    from above; ``bytes_in``/``bytes_out`` count block bytes written to / returned by it.
    """

    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    get_latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def count_read(self, elapsed_ns: int, hits: int = 0, misses: int = 0,
                   nbytes: int = 0) -> None:
        """One read call that returned after ``elapsed_ns``: the keys it hit and missed and
        the block bytes it returned (a call that failed or timed out is not a read)."""
        self.get_latency.record(elapsed_ns)
        self.hits += hits
        self.misses += misses
        self.bytes_out += nbytes

    def as_dict(self) -> dict[str, Any]:
        """Plain figures for :meth:`kvtier.store.TieredStore.stats`."""
        return {**_counts(self), "get_p50_us": self.get_latency.percentile(0.5),
                "get_p99_us": self.get_latency.percentile(0.99)}


@dataclass(slots=True)
class StoreCounters:
    """Store-wide figures: one ``get`` is one hit or one miss whatever the tier count."""

    gets: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    single_flight_joins: int = 0
    evictions_refused: int = 0
    write_through_writes: int = 0
    write_through_superseded: int = 0
    pool_writes: int = 0
    close_flushed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain figures, plus ``hit_rate`` (``None`` before the first get)."""
        return {**_counts(self),
                "hit_rate": round(self.hits / self.gets, 4) if self.gets else None}


def store_stats(tiers: Sequence[Tier], tier_counters: Sequence[TierCounters],
                counters: StoreCounters, misses: MissLedger) -> dict[str, Any]:
    """The figures of :meth:`kvtier.store.TieredStore.stats` (its docstring lists them):
    each tier's own ``stats()`` merged with what the store observed of it, then the
    store-wide counters and the misses by reason."""
    out: list[dict[str, Any]] = []
    for index, (tier, observed_counters) in enumerate(zip(tiers, tier_counters, strict=True)):
        try:
            own = tier.stats()
        except Exception as exc:  # a broken tier must not break monitoring
            own = {"scheme": tier.scheme, "name": tier.name, "capacity": None, "used": None,
                   "evictions": tier.evictions, "stats_error": repr(exc)}
        observed = {**observed_counters.as_dict(), "miss_reasons": misses.tier_dict(index)}
        # A tier's own figure of the same name (e.g. an LMDB tier's hits, which include
        # reads that bypassed the store) stays visible as tier_<name>.
        out.append({**own, **{f"tier_{k}": own[k] for k in observed if k in own}, **observed})
    return {"tiers": out, **counters.as_dict(), **misses.as_dict(),
            "miss_records": misses.held}
