"""``kvtier serve`` segments evict with ARC unless a tier URL names its own policy (issue 15:
the sessionless pool configuration that met the hit-rate goal in the most cells)."""

from __future__ import annotations

from pathlib import Path

from kvtier.commands.serve import segment_policy
from kvtier.store import open_store


def test_budgeted_tiers_without_a_policy_get_the_default() -> None:
    urls = ["dram://?capacity=1MiB", "lmdb:///x?policy=lru", "file:///y", "peers://h:1"]
    assert segment_policy(urls, "arc") == {0: {"policy": "arc"}, 2: {"policy": "arc"}}


async def test_segment_tiers_run_the_chosen_policy(tmp_path: Path) -> None:
    urls = ["dram://?capacity=1MiB", f"lmdb://{tmp_path}/l?capacity=4MiB&policy=lru"]
    async with open_store(urls, tier_options=segment_policy(urls, "arc")) as store:
        assert [t["policy"] for t in store.stats()["tiers"]] == ["arc", "lru"]
