"""``/metrics``: the peer server's counters and its segment's statistics, Prometheus text.

The exposition is done by ``prometheus_client`` when it is installed (``pip install
'kvtier[metrics]'``). Without it the same text is written here, byte for byte (the tests
compare both and parse them with ``prometheus_client``'s parser): ``# HELP`` and ``# TYPE``
once per family, counters typed ``counter`` with the ``_total`` suffix, label values and
help text escaped as the text format requires.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CONTENT_TYPE", "Family", "miss_families", "render", "repair_families",
           "store_families"]

#: Content type of the hand-written exposition (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Store statistics that are levels, not running totals; every other numeric field counts up.
_GAUGE_FIELDS = frozenset({"capacity", "used", "blocks", "pinned_bytes", "spare_bytes",
                           "map_size", "disk_bytes", "compress_level", "hit_rate",
                           "prefaulted_bytes"})
_GAUGE_SUFFIXES = ("_us", "_depth", "_s", "_seconds", "_in_flight")


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
        gauge = name in _GAUGE_FIELDS or name.endswith(_GAUGE_SUFFIXES)
        what = "level" if gauge else "running total"
        family = Family(f"kvtier_store_{name}", "gauge" if gauge else "counter",
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
