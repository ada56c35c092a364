"""Why a read missed: the reasons, a bounded per-tier record of what happened to keys, and
the counters by reason that :meth:`kvtier.store.TieredStore.stats` reports.

Each tier has a record of at most ``size`` keys (oldest forgotten first) holding the last
thing that happened to the key there: evicted by the tier's budget (and under which
policy), dropped as corrupt, or unreachable. Nothing is recorded on a hit, and a miss costs
one dictionary lookup per tier, so the read path's hit cost does not change.

Times are ``time.perf_counter_ns()`` values (the clock the read path already reads): a
reason that lasts only as long as its cause (``unavailable``) counts for a read only if it
was noted after that read began.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

__all__ = ["DEFAULT_MISS_RECORD_SIZE", "REASON_HELP", "MissLedger", "MissNote", "MissReason",
           "ReasonHelp", "Trouble", "reasons_table"]

#: Keys each tier remembers evicting (or dropping as corrupt); about 200 bytes each.
DEFAULT_MISS_RECORD_SIZE = 32768


class MissReason(StrEnum):
    """Why a key was not served."""

    #: No tier holds the key and none remembers it: never stored under this namespace (the
    #: key hashes the namespace), or forgotten past the eviction record.
    NOT_STORED = "not_stored"
    #: A tier evicted it by its byte budget (and no tier below holds it).
    EVICTED = "evicted"
    #: Removed by a ``delete`` of this store.
    DELETED = "deleted"
    #: Found, but its frame failed the checksum or could not be decoded (it was dropped).
    CORRUPT = "corrupt"
    #: The tier that would hold it failed or did not answer: owner down, its own timeout,
    #: an I/O error.
    UNAVAILABLE = "unavailable"
    #: The call's deadline ended before the tier holding it answered (or was asked): the
    #: deadline is too short for the bytes asked.
    DEADLINE = "deadline"
    #: The engine connector did not ask: the request was below one of its thresholds (a
    #: prompt shorter than one block). Counted by the connector, never by the store.
    BELOW_THRESHOLD = "below_threshold"

    # Hash as the str it is (Enum's own hash is a Python call, and a reason is counted on
    # every miss): ``counts["evicted"]`` then finds ``counts[MissReason.EVICTED]`` too.
    __hash__ = str.__hash__


#: Reasons the store counts (``below_threshold`` is the connector's own).
STORE_REASONS = tuple(r for r in MissReason if r is not MissReason.BELOW_THRESHOLD)
#: Reasons that describe a cause of the moment, not the key's history.
TRANSIENT = frozenset({MissReason.UNAVAILABLE, MissReason.DEADLINE})
_NOT_STORED = MissReason.NOT_STORED  # class attribute lookups of an Enum are slow


class ReasonHelp(NamedTuple):
    """What a reason means and what to do about it (Markdown; ``docs/troubleshooting.md``'s
    table is generated from these, see :func:`reasons_table`)."""

    #: What happened to the key.
    what: str
    #: What to look at or change.
    todo: str


REASON_HELP: dict[MissReason, ReasonHelp] = {
    MissReason.NOT_STORED: ReasonHelp(
        "No tier holds the key and none remembers it; for a `peers://` tier, every owner of "
        "the key answered \"not here\". Keys hash the namespace, so a writer and a reader "
        "that differ in model name, KV dtype, layout tag, TP rank/size, salt, block size or "
        "`key_scheme` never share a key: every lookup is `not_stored`. Also: the block was "
        "never saved (nothing writes into a tier the reader sees), or it was evicted longer "
        "ago than the record remembers.",
        "Compare the namespaces: write a lookup log on each side (`lookup_log=` on the "
        "store) and run `kvtier explain --log A.jsonl --log B.jsonl`, which names the "
        "namespace fields that differ; or `kvtier explain --prefix-of` with each side's "
        "options (the one that hits is the writer's). For vLLM the namespace is the served "
        "model name, the cache dtype, the layout `vllm/<device>/<spec>/H<heads>/D<head "
        "size>/B<block size>` and the TP size/rank (`docs/integrations/vllm.md`). Check "
        "that the tiers the reader asks (`scheduler_tiers`) are ones the writer writes "
        "through to. Raise `miss_record_size` if evictions are older than the record."),
    MissReason.EVICTED: ReasonHelp(
        "A tier's byte budget evicted the block (`evicted from tier N by POLICY, T ago`) and "
        "no tier below holds it.",
        "The tiers' `capacity=`; whether a lower (persistent, pooled) tier is in the chain; "
        "each tier's `evictions` and the store's `dropped`. A prompt larger than the top "
        "tiers loses its head first, and with it the whole prefix."),
    MissReason.DELETED: ReasonHelp(
        "A `delete` of this store removed it.",
        "Who deletes."),
    MissReason.CORRUPT: ReasonHelp(
        "A tier found the block but its frame failed the checksum or could not be decoded; "
        "it was dropped (`file://`, `lmdb://`, `redis://`, `peers://` count these; a tier's "
        "own `corrupt` figure too).",
        "The storage underneath (a torn write, another program writing the directory, a "
        "mount without coherent caching)."),
    MissReason.UNAVAILABLE: ReasonHelp(
        "The tier failed during the read (I/O error, its own `timeout=`), or, for a "
        "`peers://` tier, an owner of the key did not answer \"not here\": it is down (out "
        "of the path), suspected (failures since its last answer), stopped or slower than "
        "the pool's `timeout=`. The explanation names each such owner, its state and its "
        "last failure (`owner 10.0.0.2:7070 is down (...; last: timed out after 0.50 s)`). "
        "The block may well be stored there.",
        "The tier's `errors` in `stats()` and the WARNING lines naming it; for a pool, the "
        "named members: `kvtier stats http://member`, whether the process runs (a stopped "
        "or swapping process times out), the network between the hosts, and the pool's "
        "`timeout=` against the member's latency."),
    MissReason.DEADLINE: ReasonHelp(
        "The call's deadline ran out before the tier holding the block answered (or before "
        "it was asked): the deadline is too short for the bytes asked.",
        "The store's `timeout=` and the per-call `timeout=`; for vLLM `lookup_timeout_s` "
        "(0.1 s) and `io_timeout_s`."),
    MissReason.BELOW_THRESHOLD: ReasonHelp(
        "The connector did not ask: the prompt is shorter than one block (only full blocks "
        "are stored). Counted only by the connector.",
        "Nothing to fix for short prompts."),
}


def reasons_table() -> str:
    """The Markdown table of every reason, what happened and what to look at (the one in
    ``docs/troubleshooting.md``; ``tests/test_troubleshooting_reasons.py`` keeps them equal)."""
    rows = ["| reason | what happened | what to look at |", "|---|---|---|"]
    rows += [f"| `{reason}` | {REASON_HELP[reason].what} | {REASON_HELP[reason].todo} |"
             for reason in MissReason]
    return "\n".join(rows) + "\n"


class MissNote(NamedTuple):
    """What last happened to a key in one tier."""

    reason: MissReason
    #: ``time.perf_counter_ns()`` when it happened.
    at_ns: int
    #: The eviction policy (``lru``, ``s3fifo``, ``arc``) or the error text.
    detail: str

    def age_s(self) -> float:
        """Seconds since it happened."""
        return max(0.0, (time.perf_counter_ns() - self.at_ns) / 1e9)


class Trouble(NamedTuple):
    """A tier that gave no answer during one read: ``reason`` is ``deadline`` or
    ``unavailable``."""

    tier: int
    reason: MissReason
    detail: str


class MissLedger:
    """The per-tier records and the counters by reason of one store.

    Parameters
    ----------
    n_tiers
        Tiers in the chain.
    size
        Keys each tier's record holds at most (the oldest note is forgotten first).

    Notes
    -----
    Runs on the store's event loop only (tiers call :meth:`note` from their loop-side code).
    Memory is bounded by ``n_tiers * size`` notes.
    """

    def __init__(self, n_tiers: int, size: int = DEFAULT_MISS_RECORD_SIZE) -> None:
        self.size = size
        self._notes: list[OrderedDict[bytes, MissNote]] = [OrderedDict() for _ in range(n_tiers)]
        self.counts: dict[MissReason, int] = dict.fromkeys(STORE_REASONS, 0)
        self.lookup_counts: dict[MissReason, int] = dict.fromkeys(STORE_REASONS, 0)
        self.tier_counts: list[dict[MissReason, int]] = [{} for _ in range(n_tiers)]

    # ------------------------------------------------------------------ recording
    def note(self, index: int, key: bytes, reason: MissReason, detail: str = "") -> None:
        """Remember that ``reason`` happened to ``key`` in tier ``index`` just now."""
        notes = self._notes[index]
        notes[key] = MissNote(reason, time.perf_counter_ns(), detail)
        notes.move_to_end(key)
        if len(notes) > self.size:
            notes.popitem(last=False)

    def note_many(self, index: int, keys: Sequence[bytes], reason: MissReason,
                  detail: str = "") -> None:
        """:meth:`note` for each of ``keys``."""
        for key in keys:
            self.note(index, key, reason, detail)

    def noted(self, index: int, key: bytes, since_ns: int | None = None) -> MissNote | None:
        """Tier ``index``'s note of ``key``; a transient one only if noted at or after
        ``since_ns`` (``None``: never)."""
        found = self._notes[index].get(key)
        if found is None or found.reason not in TRANSIENT:
            return found
        return found if since_ns is not None and found.at_ns >= since_ns else None

    @property
    def held(self) -> int:
        """Notes held, all tiers together."""
        return sum(len(n) for n in self._notes)

    # ------------------------------------------------------------------ classifying
    def classify(self, key: bytes, trouble: Trouble | None, since_ns: int | None
                 ) -> tuple[MissReason, int | None, MissNote | None]:
        """Why ``key`` was missed by a read that began at ``since_ns``: the tier that gave no
        answer (``trouble``), else the most recent note of any tier, else ``not_stored``.
        Returns the reason, the tier it is attributed to and its note."""
        if trouble is not None:
            return trouble.reason, trouble.tier, None
        best: MissNote | None = None
        tier: int | None = None
        for index, notes in enumerate(self._notes):  # inlines noted(): this runs per miss
            found = notes.get(key)
            if found is None or (best is not None and found.at_ns < best.at_ns):
                continue
            if found.reason in TRANSIENT and (since_ns is None or found.at_ns < since_ns):
                continue
            best, tier = found, index
        if best is None:
            return _NOT_STORED, None, None
        return best.reason, tier, best

    def count(self, key: bytes, trouble: Trouble | None, since_ns: int | None, *,
              lookup: bool = False) -> MissReason:
        """Count one missed key (``lookup``: the key that ended a ``lookup_prefix``)."""
        reason, index, _ = self.classify(key, trouble, since_ns)
        (self.lookup_counts if lookup else self.counts)[reason] += 1
        if index is not None and not lookup:
            per_tier = self.tier_counts[index]
            per_tier[reason] = per_tier.get(reason, 0) + 1
        return reason

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``miss_reasons`` and ``lookup_miss_reasons`` for the store's stats."""
        return {"miss_reasons": {str(r): n for r, n in self.counts.items()},
                "lookup_miss_reasons": {str(r): n for r, n in self.lookup_counts.items()}}

    def tier_dict(self, index: int) -> dict[str, int]:
        """Misses attributed to tier ``index``, by reason."""
        return {str(r): n for r, n in self.tier_counts[index].items()}
