"""``kvtier_shm_*``: the host daemon's families on ``kvtier serve --shm NAME``'s ``/metrics``.

Beside the peer server's and the store's families (the daemon's store is the segment, so
its tiers are ``kvtier_store_*`` already), these say what the engines of the host do with
the shared arena: slots lent and returned, saves prepared and committed, the presence index,
the processes attached. Levels are gauges; running totals counters (``_total`` on output),
which never go down while the daemon lives (``tests/test_metrics.py`` scrapes them before and
after churn). The arena carves slots by size class, so its "slots" are given in bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from kvtier.peer.metrics import Family

__all__ = ["SHM_FAMILIES", "shm_families"]

#: ``(statistic, kind, help)`` of every family, named ``kvtier_shm_<statistic>``; the
#: statistics are :meth:`kvtier.shm.server.LocalServer.metric_stats`'.
SHM_FAMILIES: tuple[tuple[str, Literal["counter", "gauge"], str], ...] = (
    ("arena_bytes", "gauge", "Bytes of the shared arena (capacity plus staging room)."),
    ("arena_used_bytes", "gauge", "Bytes of the shared arena in slots now."),
    ("leased_bytes", "gauge", "Arena bytes under read leases (engines copying hits out)."),
    ("prepared_bytes", "gauge", "Arena bytes under write leases (saves being copied in)."),
    ("leases", "gauge", "Read leases out."),
    ("prepared", "gauge", "Write leases out (prepared saves not committed or aborted)."),
    ("clients", "gauge", "Engine processes holding a lease."),
    ("attached", "gauge", "Engine processes the daemon watches (they leased, saved or pinned, "
                          "and have not exited)."),
    ("index_entries", "gauge", "Keys in the shared presence index."),
    ("index_slots", "gauge", "Entries the shared presence index has room for."),
    ("leases_granted", "counter", "Read leases granted (slots lent for a hit's copy)."),
    ("leases_released", "counter", "Read leases released while still valid."),
    ("leases_expired", "counter", "Leases (read or write) that ended at their time bound."),
    ("leases_dropped", "counter", "Leases that ended because their process exited."),
    ("prepares", "counter", "Write leases granted (slots lent for a save's copy)."),
    ("prepare_refused", "counter", "Blocks of a prepare that got no slot (arena full)."),
    ("commits", "counter", "Prepared blocks committed into the daemon's store."),
    ("commits_superseded", "counter", "Commits that did not land: a newer write or a delete "
                                      "of the key landed first."),
    ("aborts", "counter", "Prepared blocks aborted (the engine's copy failed, or it gave "
                          "up waiting)."),
    ("leased_bytes_granted", "counter", "Bytes lent under read leases (engines copy them "
                                        "out of the arena)."),
    ("committed_bytes", "counter", "Bytes committed from engines' copies into the arena."),
    ("staged", "counter", "Hits the daemon copied into a staging slot first (blocks held "
                          "outside the arena)."),
    ("staged_bytes", "counter", "Bytes the daemon copied into staging slots."),
    ("index_refused", "counter", "Keys the full presence index could not take."),
    ("index_resyncs", "counter", "Times the index's event feed lost events and rebuilt it."),
    ("refused", "counter", "Requests refused: a process of another user."),
    ("bad_requests", "counter", "Requests refused as malformed (400)."),
)


def shm_families(stats: Mapping[str, float]) -> list[Family]:
    """One family per entry of :data:`SHM_FAMILIES`, from ``stats`` (a missing one is 0)."""
    out = []
    for name, kind, text in SHM_FAMILIES:
        family = Family(f"kvtier_shm_{name}", kind, text)
        family.add(stats.get(name, 0))
        out.append(family)
    return out
