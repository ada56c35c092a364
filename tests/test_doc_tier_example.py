"""The worked ``BudgetedTier`` of ``docs/writing-a-tier.md`` runs, as written, through the
conformance suite (worker-thread cases included), so the example stays true."""

from __future__ import annotations

import re
import types
from pathlib import Path

from kvtier.testing.conformance import TierConformance
from kvtier.tiers.base import Tier

_DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-tier.md"
_HEADER = 24 + 8 + 3 + 8  # frame header of a 1-d '<u2' or '|u1' block


def _example() -> types.ModuleType:
    section = _DOC.read_text(encoding="utf-8").split("## A worked `BudgetedTier`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the worked example has no python block"
    module = types.ModuleType("dirtier_example")
    exec(compile(code.group(1), str(_DOC), "exec"), module.__dict__)
    return module


DirTier = _example().DirTier


class TestDocExampleConformance(TierConformance):
    async def make_tier(self, capacity: int | None) -> Tier:
        root = self.tmp_path / f"dir{len(self._created)}"
        tier: Tier = DirTier.from_url(f"dirtier://{root}", capacity=capacity)
        return tier

    def capacity_for(self, n_blocks: int, block_nbytes: int = 1024) -> int:
        return n_blocks * (block_nbytes + _HEADER)
