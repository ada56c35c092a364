"""Metrics that mean what they say (issue 31): in a real `kvtier serve` /metrics no counter
family ever goes down under churn, levels are gauges, and ``kvtier.metrics`` exposes an
embedded store's families through ``prometheus_client``."""

from __future__ import annotations

import asyncio
import os
import sys
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvtier.metrics
from kvtier.errors import ConfigError
from kvtier.peer.metrics import classified
from kvtier.peer.tier import PeerTier
from kvtier.shm.client import LocalClient
from kvtier.shm.metrics import SHM_FAMILIES
from kvtier.store import open_store
from kvtier.testing.conformance import key_of
from kvtier.tiers.local import LocalTier
from tests.helpers.peer_helpers import REPO, TOKEN, serve_processes
from tests.helpers.shm_helpers import running_daemon

BLOCK = 128 << 10


def _samples(text: str) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float],
                                 dict[str, str]]:
    """Every sample by (name, labels), and every family's type."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    kinds: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        kinds[family.name] = family.type
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_created"):
                continue
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values, kinds


async def _scrape(member: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(
            f"http://{member}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=aiohttp.ClientTimeout(total=20)) as resp:
        assert resp.status == 200
        return await resp.text()


async def _churn(tier: PeerTier, start: int, count: int, *, deletes_first: bool) -> None:
    keys = [key_of(i) for i in range(start, start + count)]
    if deletes_first:  # a few blocks of the round before (gone already: misses)
        for i in range(start - count, start, 6):
            await tier.delete(key_of(i))
    for key in keys:
        await tier.put(key, np.full(BLOCK, keys.index(key) % 251, np.uint8))
    for key in keys[::2]:
        await tier.get(key)
    if not deletes_first:
        for key in keys:  # every arena slot of DRAM is released
            await tier.delete(key)


@pytest.mark.slow
async def test_no_counter_of_kvtier_serve_goes_down_under_churn(tmp_path: Path) -> None:
    args = ["--tier", "dram://?capacity=1MiB", "--tier", f"lmdb://{tmp_path}/l?capacity=2MiB"]
    with serve_processes(tmp_path, 1, args) as (proc,):
        tier = PeerTier.from_url(f"peers://{proc.member}?token={TOKEN}&timeout=10")
        try:
            # Fills DRAM, demotes into LMDB, which evicts too; ends deleting every block, so
            # DRAM's arena slots are all released ...
            await _churn(tier, 0, 24, deletes_first=False)
            before, kinds = _samples(await _scrape(proc.member))
            # ... which deletes, puts (evictions) and promotions take up again: the arena's
            # free bytes go down, as a level may.
            await _churn(tier, 24, 24, deletes_first=True)
            after, kinds_after = _samples(await _scrape(proc.member))
        finally:
            await tier.aclose()
    assert kinds == kinds_after
    counters = [name for name, kind in kinds.items() if kind == "counter"]
    assert len(counters) >= 20 and len(kinds) - len(counters) >= 10
    went_down = sorted(f"{name}{dict(labels)}: {value} -> {after[(name, labels)]}"
                       for (name, labels), value in before.items()
                       if kinds.get(name.removesuffix("_total")) == "counter"
                       and (name, labels) in after and after[(name, labels)] < value)
    assert not went_down, f"counters that decreased: {went_down}"
    # What the churn moved: evictions and deletes counted, arena levels typed as levels.
    evictions = ("kvtier_store_evictions_total", (("scheme", "dram"), ("tier", "0")))
    assert after[evictions] > before[evictions] > 0
    for level in ("kvtier_store_arena_bytes", "kvtier_store_arena_free_bytes",
                  "kvtier_store_arena_unused_bytes", "kvtier_store_used",
                  "kvtier_store_leaving", "kvtier_peer_connections"):
        assert kinds[level] == "gauge", level
    # Only counters end in _total, and every per-tier statistic has a known kind.
    assert not [n for n, k in kinds.items() if k != "counter" and n.endswith("_total")]
    unknown = [n for n in kinds if n.startswith("kvtier_store_")
               and not classified(n.removeprefix("kvtier_store_"))
               and n not in {f.name for f in _store_wide()}]
    assert not unknown, f"per-tier statistics of unknown kind: {unknown}"


def _store_wide() -> list[kvtier.peer.metrics.Family]:
    from kvtier.peer.metrics import miss_families, store_wide_families
    stats = {name: 1 for name in ("gets", "hits", "misses", "puts", "deletes",
                                  "single_flight_joins", "evictions_refused",
                                  "write_through_writes", "write_through_superseded",
                                  "pool_writes", "close_flushed", "events_emitted",
                                  "events_dropped", "write_queue_depth",
                                  "write_queue_bytes", "event_subscribers")}
    return store_wide_families(stats) + miss_families({"miss_reasons": {"evicted": 1}})


async def test_an_embedded_store_registers_its_families(tmp_path: Path) -> None:
    store = await open_store(["dram://?capacity=512KiB", f"lmdb://{tmp_path}/l"])
    try:
        for i in range(8):
            await store.put(key_of(i), np.full(BLOCK, i, np.uint8))
        await store.get(key_of(0))
        await store.get(key_of(999))
        registry = CollectorRegistry()
        collector = kvtier.metrics.register(store, registry)
        values, kinds = _samples(generate_latest(registry).decode())
        assert kinds["kvtier_store_evictions"] == "counter"
        assert kinds["kvtier_store_used"] == "gauge"
        assert values[("kvtier_store_puts_total", ())] == 8
        assert values[("kvtier_store_get_misses_total", ())] == 1
        assert values[("kvtier_store_evictions_total", (("scheme", "dram"), ("tier", "0")))] \
            == store.stats()["tiers"][0]["evictions"] > 0
        assert values[("kvtier_store_misses_by_reason_total",
                       (("op", "get"), ("reason", "not_stored")))] == 1
        registry.unregister(collector)
        assert "kvtier_" not in generate_latest(registry).decode()
    finally:
        await store.aclose()


async def test_start_http_server_serves_the_store_from_its_own_thread() -> None:
    store = await open_store(["dram://?capacity=1MiB"])
    server = kvtier.metrics.start_http_server(store, port=0)
    try:
        await store.put(key_of(1), np.zeros(1024, np.uint8))
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

        def fetch() -> str:
            with urllib.request.urlopen(url, timeout=20) as resp:
                return str(resp.read().decode())

        # The scrape runs on the server's thread and reads the stats on the store's loop,
        # which must keep running meanwhile.
        text = await asyncio.to_thread(fetch)
        values, _ = _samples(text)
        assert values[("kvtier_store_puts_total", ())] == 1
        assert values[("kvtier_store_blocks", (("scheme", "dram"), ("tier", "0")))] == 1
    finally:
        server.shutdown()
        server.server_close()
        await store.aclose()


async def test_without_prometheus_client_the_error_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = await open_store(["dram://"])
    try:
        monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
        with pytest.raises(ConfigError, match=r"kvtier\[metrics\]"):
            kvtier.metrics.register(store)
        with pytest.raises(ConfigError, match=r"kvtier\[metrics\]"):
            kvtier.metrics.start_http_server(store, port=0)
    finally:
        await store.aclose()


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(TypeError, match="store: expected a TieredStore"):
        kvtier.metrics.register(object(), CollectorRegistry())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        kvtier.metrics.start_http_server(object(), port=70000)  # type: ignore[arg-type]


async def test_every_numeric_tier_statistic_has_a_known_kind(tmp_path: Path) -> None:
    """A new statistic must be classified (kvtier/peer/metrics.py): unknown ones are exported
    as gauges, which would drop a running total's ``_total``."""
    from kvtier.peer.server import PeerServer
    from kvtier.tiers.dram import DRAMTier

    server = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await server.start()
    try:
        store = await open_store([
            "dram://?capacity=512KiB", f"peers://{server.member_id}?token={TOKEN}&timeout=5",
            f"lmdb://{tmp_path}/l?capacity=1MiB", f"file://{tmp_path}/f"])
        try:
            for i in range(12):
                await store.put(key_of(i), np.full(BLOCK, i, np.uint8))
            await store.get(key_of(0))
            fields = {k for t in store.stats()["tiers"] for k, v in t.items()
                      if isinstance(v, int | float) and not isinstance(v, bool)}
        finally:
            await store.aclose()
    finally:
        await server.stop()
    assert {"arena_bytes", "copies_made", "disk_bytes", "hits"} <= fields
    assert not sorted(f for f in fields if not classified(f))


# A process that keeps taking read leases of the daemon until it is killed (its leases then
# end with it: kvtier_shm_leases_dropped; a new one every 0.1 s, so some are within their
# time bound at the kill however late it comes).
_HOLDER = """
import asyncio, sys
from kvtier.shm.client import LocalClient
async def main():
    client = LocalClient(sys.argv[1], timeout=10)
    await client.attach()
    while True:
        answer = await client.call("/v1/lease", {"keys": [sys.argv[2]]})
        assert answer["slots"][0] is not None, answer
        print("holding", flush=True)
        await asyncio.sleep(0.1)
asyncio.run(main())
"""


async def _shm_churn(tier: LocalTier, client: LocalClient, start: int, ttl: float) -> None:
    """Saves past the daemon's capacity, hits, deletes, a refused, an aborted and a
    superseded save, a lease left to expire and one whose process is killed."""
    keys = [key_of(i) for i in range(start, start + 12)]
    for i, key in enumerate(keys):
        await tier.put(key, np.full(BLOCK, i % 251, np.uint8))
    for key in keys[-4:]:
        assert await tier.get(key) is not None
    await tier.delete(keys[-1])
    spec = {"key": key_of(10_000 + start).hex(), "dtype": "|u1", "shape": [BLOCK]}
    first, second = [(await client.call("/v1/prepare", {"blocks": [spec]}))["slots"][0]["lease"]
                     for _ in range(2)]
    await client.call("/v1/commit", {"leases": [second]})
    await client.call("/v1/commit", {"leases": [first]})  # an older write: superseded
    too_big = {**spec, "shape": [2 << 20]}  # past the daemon's capacity: refused
    assert (await client.call("/v1/prepare", {"blocks": [too_big]}))["slots"] == [None]
    aborted = (await client.call("/v1/prepare", {"blocks": [spec]}))["slots"][0]["lease"]
    await client.call("/v1/commit", {"leases": [aborted], "abort": True})
    await client.call("/v1/lease", {"keys": [keys[-2].hex()]})  # never released
    before = await tier.daemon_stats()
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, tier.daemon, keys[-3].hex(), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 60)
        assert line.strip() == b"holding", line
    finally:
        holder.kill()
        await holder.wait()
    for _ in range(int(20 / ttl) * 10):  # the lease ends at its time bound, the holder's at
        stats = await tier.daemon_stats()  # its exit
        if stats["expired"] > before["expired"] and stats["dropped"] > before["dropped"] \
                and stats["leases"] == 0:
            return
        await asyncio.sleep(ttl / 10)
    raise AssertionError(f"leases never ended: {stats}")


@pytest.mark.slow
async def test_no_shm_counter_of_the_daemon_goes_down_under_churn(tmp_path: Path) -> None:
    with running_daemon(tmp_path, None, "1MiB", "--shm-lease-ttl", "2") as proc:
        tier = LocalTier(proc.shm_name, timeout=10)
        client = LocalClient(proc.shm_name, timeout=10)
        try:
            await client.attach()
            await _shm_churn(tier, client, 0, 2)
            before, kinds = _samples(await _scrape(proc.member))
            await _shm_churn(tier, client, 100, 2)
            after, kinds_after = _samples(await _scrape(proc.member))
        finally:
            await client.aclose()
            await tier.aclose()
    assert kinds == kinds_after
    shm = {name: kind for name, kind, _ in SHM_FAMILIES}
    assert {n.removeprefix("kvtier_shm_"): k for n, k in kinds.items()
            if n.startswith("kvtier_shm_")} == shm
    went_down = sorted(f"{name}{dict(labels)}: {value} -> {after[(name, labels)]}"
                       for (name, labels), value in before.items()
                       if kinds.get(name.removesuffix("_total")) == "counter"
                       and (name, labels) in after and after[(name, labels)] < value)
    assert not went_down, f"counters that decreased: {went_down}"
    # Every shm counter moved in each round (the first as well: it is above 0).
    still = [name for name, kind in shm.items() if kind == "counter" and not (
        after[(f"kvtier_shm_{name}_total", ())] > before[(f"kvtier_shm_{name}_total", ())] > 0)]
    assert sorted(still) == ["bad_requests", "index_refused", "index_resyncs", "refused",
                             "staged", "staged_bytes"]
    assert before[("kvtier_shm_commits_total", ())] >= 12 + 1
    assert after[("kvtier_shm_attached", ())] == 1  # this process; the killed holder is gone
    assert after[("kvtier_shm_leases", ())] == 0 == after[("kvtier_shm_leased_bytes", ())]
    assert after[("kvtier_shm_index_entries", ())] > 0
