"""``TieredStore.explain``: where each key was looked for and why it missed (or where it hit).

Each tier is probed with its presence check (no recency refreshed, nothing promoted), and a
key no tier holds is explained from what the tiers noted of it (:mod:`kvtier.misses`): the
tier that evicted it and under which policy, or dropped it as corrupt, or that did not
answer now. The result is typed (:class:`Explanation`, one per key) and prints readably.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.misses import MissNote, MissReason, Trouble

if TYPE_CHECKING:
    from kvtier.readpath import ReadPath
    from kvtier.tierchain import TierChain

__all__ = ["Explanation", "TierLook", "explain_keys"]


@dataclass(frozen=True, slots=True)
class TierLook:
    """What one tier said about one key.

    Attributes
    ----------
    index, tier
        The tier's position (0: top) and name.
    found
        Whether the tier holds the key.
    reason
        Why it does not (``None`` when found, or when it has no record of the key).
    detail
        The eviction policy, or the error / corruption text.
    age_s
        Seconds since the tier noted ``reason`` (``None`` without a note).
    """

    index: int
    tier: str
    found: bool
    reason: MissReason | None = None
    detail: str = ""
    age_s: float | None = None

    def __str__(self) -> str:
        if self.found:
            return "holds it"
        if self.reason is None:
            return "not here (no record of it)"
        ago = f" {_ago(self.age_s)}" if self.age_s is not None else ""
        if self.reason is MissReason.EVICTED:
            return f"evicted{ago}" + (f" ({self.detail} policy)" if self.detail else "")
        if self.reason is MissReason.DELETED:
            return f"deleted{ago}"
        if self.reason is MissReason.CORRUPT:
            return f"dropped as corrupt{ago}: {self.detail}"
        return f"{self.reason}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        """Plain values (for JSON)."""
        return {"index": self.index, "tier": self.tier, "found": self.found,
                "reason": None if self.reason is None else str(self.reason),
                "detail": self.detail,
                "age_s": None if self.age_s is None else round(self.age_s, 3)}


@dataclass(frozen=True, slots=True)
class Explanation:
    """Where one key was looked for, and where it hit or why it missed.

    Attributes
    ----------
    key
        The key.
    hit_tier
        Index of the first tier holding it (where a ``get`` is served from), or ``None``.
    reason
        Why a ``get`` misses it (``None`` on a hit).
    reason_tier
        The tier ``reason`` is attributed to (``None`` for ``not_stored``, or on a hit).
    tiers
        One :class:`TierLook` per tier, top first.
    """

    key: bytes
    hit_tier: int | None
    reason: MissReason | None
    reason_tier: int | None
    tiers: tuple[TierLook, ...]

    @property
    def hit(self) -> bool:
        """Whether some tier holds the key."""
        return self.hit_tier is not None

    def summary(self) -> str:
        """One line: where it hits, or the reason it misses in words."""
        if self.hit_tier is not None:
            return f"HIT in tier {self.hit_tier} ({self.tiers[self.hit_tier].tier})"
        reason = self.reason or MissReason.NOT_STORED
        look = None if self.reason_tier is None else self.tiers[self.reason_tier]
        name = f"tier {look.index} ({look.tier})" if look is not None else "?"
        ago = f" {_ago(look.age_s)}" if look is not None and look.age_s is not None else ""
        detail = look.detail if look is not None else ""
        if reason is MissReason.EVICTED:
            by = f" by {detail}" if detail else ""
            text = f"evicted from {name}{by}{ago}; no tier below holds it"
        elif reason is MissReason.CORRUPT:
            text = f"found in {name} but corrupt ({detail}), dropped{ago}"
        elif reason is MissReason.DELETED:
            text = f"deleted from {name}{ago} (a delete() of this store)"
        elif reason is MissReason.UNAVAILABLE:
            text = f"{name} did not answer: {detail}"
        elif reason is MissReason.DEADLINE:
            text = f"deadline too short for the bytes asked: {detail}"
        else:
            text = ("no tier holds it or remembers it: never stored under this namespace "
                    "(or forgotten past the eviction record)")
        return f"MISS ({reason}): {text}"

    def __str__(self) -> str:
        lines = [f"{self.key.hex()}  {self.summary()}"]
        lines += [f"  tier {t.index} {t.tier}: {t}" for t in self.tiers]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (for JSON)."""
        return {"key": self.key.hex(), "hit_tier": self.hit_tier,
                "reason": None if self.reason is None else str(self.reason),
                "reason_tier": self.reason_tier,
                "summary": self.summary(), "tiers": [t.as_dict() for t in self.tiers]}


async def explain_keys(chain: TierChain, reads: ReadPath, keys: Sequence[bytes],
                       deadline: float | None) -> list[Explanation]:
    """Probe every tier for ``keys`` (one presence batch per tier) and explain each key."""
    since = time.perf_counter_ns()
    answers: list[list[bool] | Trouble] = [await reads.probe(index, keys, deadline)
                                           for index in range(len(chain))]
    out: list[Explanation] = []
    for j, key in enumerate(keys):
        looks: list[TierLook] = []
        trouble: Trouble | None = None
        for index, answer in enumerate(answers):
            name = chain.tiers[index].name
            if isinstance(answer, Trouble):
                trouble = trouble or answer
                looks.append(TierLook(index, name, False, answer.reason, answer.detail))
            elif answer[j]:
                looks.append(TierLook(index, name, True))
            else:
                looks.append(_from_note(index, name, chain.misses.noted(index, key, since)))
        hit = next((t.index for t in looks if t.found), None)
        reason, reason_tier = None, None
        if hit is None:
            reason, reason_tier, _ = chain.misses.classify(key, trouble, since)
        out.append(Explanation(key, hit, reason, reason_tier, tuple(looks)))
    return out


def _from_note(index: int, name: str, note: MissNote | None) -> TierLook:
    if note is None:
        return TierLook(index, name, False)
    return TierLook(index, name, False, note.reason, note.detail, note.age_s())


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms ago"
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min ago"
    return f"{seconds / 3600:.1f} h ago"
