"""``/metrics``: the peer server's counters and its segment's statistics, Prometheus text.

The exposition is done by ``prometheus_client`` when it is installed (``pip install
'kvtier[metrics]'``). Without it the same text is written here, byte for byte (the tests
compare both and parse them with ``prometheus_client``'s parser): ``# HELP`` and ``# TYPE``
once per family, counters typed ``counter`` with the ``_total`` suffix (and only counters:
a level is a gauge, see :func:`field_kind`), label values and help text escaped as the text
format requires.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CONTENT_TYPE",
    "COUNTER_FIELDS",
    "GAUGE_FIELDS",
    "Family",
    "classified",
    "field_kind",
    "miss_families",
    "render",
    "repair_families",
    "segment_families",
    "store_families",
    "store_wide_families",
]

#: Content type of the hand-written exposition (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Per-tier statistics by kind. A level (what a tier holds or is configured with now) is a
# gauge; a running total that only grows while the process lives is a counter (``_total``).
# Kept explicit both ways: a level typed as a counter makes ``rate()`` read a shrink as a
# reset (kvtier_store_arena_*_bytes were counters once). A field in neither set is a gauge,
# the kind that cannot mislead ``rate()``; tests/test_metrics.py fails on such a field.
GAUGE_FIELDS = frozenset({
    "capacity", "used", "blocks", "pinned_bytes", "spare_bytes", "leaving", "map_size",
    "disk_bytes", "compress_level", "hit_rate", "prefaulted_bytes", "arena_bytes",
    "arena_free_bytes", "arena_unused_bytes", "hints", "replicas", "walk_limit",
    "holders_known", "answer_buffers_reserved", "slots", "free_slots", "reserved_slots",
    "block_bytes", "fleet_capacity", "gc_remaining_bytes", "ttl"})
COUNTER_FIELDS = frozenset({
    "hits", "misses", "errors", "timeouts", "promotions", "demotions", "bytes_in",
    "bytes_out", "evictions", "eviction_errors", "arena_reused", "arena_overflow",
    "recycled", "io_errors", "corrupt", "map_full", "reads_inline", "reads_nowait",
    "read_slots_reused", "tier_hits", "tier_misses", "tier_errors", "tier_timeouts",
    "hints_dropped", "member_failures", "member_recoveries", "answer_buffers_reused",
    "gc_runs", "gc_deleted", "gc_errors", "gc_freed_bytes", "gc_skipped", "use_log_lines",
    "use_log_errors", "vanished", "copies_made", "hedge_wins", "hedged_reads",
    "hints_handed_over", "owners_verified", "puts_under_replicated", "read_repairs",
    "read_repairs_dropped", "walk_hits", "refused_writes", "refused_deletes",
    "remote_hits", "local_copies", "local_copies_dropped", "hinted_deletes_handed_over",
    "watch_changes", "watch_errors", "wipes"})
_GAUGE_SUFFIXES = ("_us", "_depth", "_s", "_seconds", "_in_flight")
_COUNTER_SUFFIXES = ("_requests",)  # a peer tier's per-operation request counts


def field_kind(name: str) -> Literal["counter", "gauge"]:
    """``counter`` for a per-tier statistic that only grows, ``gauge`` for a level (and for
    a field kvtier does not know, see :data:`GAUGE_FIELDS`)."""
    if name in COUNTER_FIELDS:
        return "counter"
    if name in GAUGE_FIELDS or name.endswith(_GAUGE_SUFFIXES):
        return "gauge"
    return "counter" if name.endswith(_COUNTER_SUFFIXES) else "gauge"


def classified(name: str) -> bool:
    """Whether kvtier knows the kind of the per-tier statistic ``name``."""
    return (name in COUNTER_FIELDS or name in GAUGE_FIELDS
            or name.endswith(_GAUGE_SUFFIXES + _COUNTER_SUFFIXES))


@dataclass
class Family:
    """One metric family: ``name`` without the ``_total`` suffix counters get on output."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def add(self, value: float, *labels: str) -> None:
        if len(labels) != len(self.labels):
            raise ValueError(f"{self.name}: expected labels {self.labels}, got {labels}")
        self.samples.append((labels, float(value)))


def store_families(tiers: Sequence[dict[str, Any]]) -> list[Family]:
    """One family per numeric field of the segment's per-tier statistics."""
    fields = sorted({k for t in tiers for k, v in t.items() if _numeric(v)})
    out = []
    for name in fields:
        kind = field_kind(name)
        what = "level" if kind == "gauge" else "running total"
        family = Family(f"kvtier_store_{name}", kind,
                        f"Segment tier statistic {name!r} ({what}).", ("tier", "scheme"))
        for i, tier in enumerate(tiers):
            if _numeric(tier.get(name)):
                family.add(tier[name], str(i), str(tier.get("scheme")))
        out.append(family)
    return out


def miss_families(stats: dict[str, Any]) -> list[Family]:
    """``kvtier_store_misses_by_reason``: the segment store's misses by reason (its
    ``miss_reasons`` and ``lookup_miss_reasons``; none for a bare tier segment)."""
    family = Family("kvtier_store_misses_by_reason", "counter",
                    "Store misses by reason (op get: reads; op lookup: the key that ended a "
                    "prefix lookup).", ("op", "reason"))
    for op, field_name in (("get", "miss_reasons"), ("lookup", "lookup_miss_reasons")):
        counts = stats.get(field_name)
        if isinstance(counts, dict):
            for reason, n in sorted(counts.items()):
                family.add(n, op, str(reason))
    return [family] if family.samples else []


#: Store-wide counters of ``TieredStore.stats()`` -> family name (``hits``/``misses`` are
#: renamed: the per-tier families already have those names).
_STORE_COUNTERS = {"gets": "kvtier_store_gets", "hits": "kvtier_store_get_hits",
                   "misses": "kvtier_store_get_misses", "puts": "kvtier_store_puts",
                   "deletes": "kvtier_store_deletes",
                   "single_flight_joins": "kvtier_store_single_flight_joins",
                   "evictions_refused": "kvtier_store_evictions_refused",
                   "write_through_writes": "kvtier_store_write_through_writes",
                   "write_through_superseded": "kvtier_store_write_through_superseded",
                   "pool_writes": "kvtier_store_pool_writes",
                   "close_flushed": "kvtier_store_close_flushed",
                   "events_emitted": "kvtier_events_emitted",
                   "events_dropped": "kvtier_events_dropped"}
_STORE_GAUGES = {"write_queue_depth": "kvtier_store_write_queue_depth",
                 "write_queue_bytes": "kvtier_store_write_queue_bytes",
                 "event_subscribers": "kvtier_events_subscribers"}


def store_wide_families(stats: dict[str, Any]) -> list[Family]:
    """The store-wide figures of a ``TieredStore.stats()`` (none for a bare tier)."""
    out = []
    for table, kind in ((_STORE_COUNTERS, "counter"), (_STORE_GAUGES, "gauge")):
        for field_name, name in table.items():
            value: Any = stats.get(field_name)
            if _numeric(value):
                what = "running total" if kind == "counter" else "level"
                family = Family(name, kind,  # type: ignore[arg-type]
                                f"Store statistic {field_name!r} ({what}).")
                family.add(float(value))
                out.append(family)
    return out


def segment_families(segment_stats: dict[str, Any]) -> list[Family]:
    """Every family of a store's (or a bare tier's) ``stats()``: per tier, store-wide and
    misses by reason."""
    tiers = segment_stats.get("tiers")
    if not isinstance(tiers, list):
        return store_families([segment_stats])
    return (store_families(tiers) + store_wide_families(segment_stats)
            + miss_families(segment_stats))


def repair_families(stats: Callable[[], dict[str, Any]] | None) -> list[Family]:
    """``kvtier_peer_repair_<counter>``: the anti-entropy counters of the node (passes,
    checked, pushed, failed, under_replicated, ...; none when it runs no anti-entropy)."""
    if stats is None:
        return []
    out = []
    for name, value in sorted(stats().items()):
        if _numeric(value):
            family = Family(f"kvtier_peer_repair_{name}", "counter",
                            f"Anti-entropy {name!r} over every pass (running total).")
            family.add(value)
            out.append(family)
    return out


def local_families(stats: Callable[[], dict[str, Any]] | None) -> list[Family]:
    """``kvtier_peer_local_<name>``: this member's ``placement=local`` figures
    (:meth:`kvtier.peer.holder.LocalHolder.stats`; none under another placement):
    counters of blocks registered, forwarded and dropped, gauges ``directory_keys`` and
    ``evict_age`` (seconds, absent until the first eviction)."""
    if stats is None:
        return []
    out = []
    for name, value in sorted(stats().items()):
        if _numeric(value):
            gauge = name in ("directory_keys", "evict_age")
            family = Family(f"kvtier_peer_local_{name}", "gauge" if gauge else "counter",
                            f"placement=local {name!r}" + ("" if gauge else
                                                           " (running total)") + ".")
            family.add(value)
            out.append(family)
    return out


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def render(families: Sequence[Family]) -> tuple[bytes, str]:
    """The exposition of ``families`` and its content type."""
    try:
        from prometheus_client import exposition
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
        from prometheus_client.registry import Collector, CollectorRegistry
    except ImportError:
        return _render_text(families).encode(), CONTENT_TYPE

    class _Snapshot(Collector):
        def collect(self) -> Iterator[Metric]:
            for fam in families:
                cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
                metric = cls(fam.name, fam.help, labels=list(fam.labels))
                for labels, value in fam.samples:
                    metric.add_metric(list(labels), value)
                yield metric

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return exposition.generate_latest(registry), str(exposition.CONTENT_TYPE_LATEST)


def _render_text(families: Sequence[Family]) -> str:
    lines = []
    for fam in families:
        name = f"{fam.name}_total" if fam.kind == "counter" else fam.name
        text = fam.help.replace("\\", r"\\").replace("\n", r"\n")
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {fam.kind}"]
        for labels, value in fam.samples:
            # Sorted by label name, as prometheus_client writes them.
            pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(zip(fam.labels, labels,
                                                                         strict=True)))
            lines.append(f"{name}{{{pairs}}} {_number(value)}" if pairs
                         else f"{name} {_number(value)}")
    return "".join(line + "\n" for line in lines)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    """Go's float formatting, as Prometheus (and prometheus_client) write sample values."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text
