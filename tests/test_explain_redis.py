"""Miss reasons of a ``redis://`` tier against a real redis-server: a corrupt value, then the
server gone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.misses import MissReason
from kvtier.store import open_store
from kvtier.testing.conformance import key_of

redis_servers = pytest.importorskip("tests.helpers.redis_servers", reason="redis-py not installed")
if redis_servers.MISSING:
    pytest.skip(redis_servers.MISSING, allow_module_level=True)


async def test_redis_corrupt_value_then_server_down(tmp_path: Path) -> None:
    server = redis_servers.RedisServer(tmp_path / "redis")
    server.start()
    try:
        url = f"redis://{server.address}?prefix=explain:&timeout=0.5"
        async with open_store(["dram://?capacity=1MiB", url]) as store:
            redis_tier = store.tiers[1]
            await redis_tier.put(key_of(1), np.arange(512, dtype=np.uint16))
            with server.client() as raw:
                frame = raw.get(b"explain:" + key_of(1))
                raw.set(b"explain:" + key_of(1), frame[:-1])  # torn
            assert await store.get(key_of(1)) is None
            [e] = await store.explain([key_of(1)])
            assert e.reason is MissReason.CORRUPT and e.reason_tier == 1
            server.kill()
            assert await store.get(key_of(2)) is None
            reasons = {r: n for r, n in store.stats()["miss_reasons"].items() if n}
            assert reasons == {"corrupt": 1, "unavailable": 1}
            [e] = await store.explain([key_of(2)])
            assert e.reason is MissReason.UNAVAILABLE and "redis" in e.tiers[1].detail
    finally:
        server.kill()
