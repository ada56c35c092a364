"""``docs/grafana-kvtier.json`` queries only metrics kvtier exports (issue 22 item 7): every
``kvtier_*`` name in its panel expressions appears in the ``/metrics`` of a real peer server
whose segment is a DRAM arena over an LMDB tier, after real traffic."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import numpy as np

from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.store import open_store
from kvtier.testing.conformance import key_of
from tests.helpers.peer_helpers import TOKEN

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-kvtier.json"
_NAME = re.compile(r"\bkvtier_[a-z0-9_]+")


def _queried() -> set[str]:
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 10
    return {name for e in exprs for name in _NAME.findall(e)}


async def _exported(tmp_path: Path) -> str:
    store = await open_store(["dram://?capacity=4MiB", f"lmdb://{tmp_path}/l?capacity=64MiB"])
    server = PeerServer(store, token=TOKEN, close_segment=True)
    await server.start()
    try:
        tier = PeerTier.from_url(f"peers://{server.member_id}?token={TOKEN}&timeout=5")
        try:
            for i in range(8):
                await tier.put(key_of(i), np.full(256 << 10, i, np.uint8))  # some demote
            await tier.get(key_of(7))
            await tier.get(key_of(99))  # a miss
        finally:
            await tier.aclose()
        async with aiohttp.ClientSession() as http, http.get(
                f"http://{server.member_id}/metrics",
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=aiohttp.ClientTimeout(total=10)) as resp:
            assert resp.status == 200
            return await resp.text()
    finally:
        await server.stop()


async def test_every_queried_metric_is_exported(tmp_path: Path) -> None:
    text = await _exported(tmp_path)
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line.startswith("kvtier_")}
    missing = sorted(_queried() - exported)
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"
