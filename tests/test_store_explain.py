"""Miss reasons and ``explain``: each reason produced by a real tier, counted in ``stats()``
and told by ``store.explain`` (and by ``kvtier explain`` from a shell)."""
# The tests inspect tier directories directly from async code, on purpose.
# ruff: noqa: ASYNC240

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier import BlockingStore, KeyNamespace, TieredStore, open_store, prefix_keys
from kvtier.cli import main
from kvtier.explain import Explanation
from kvtier.misses import MissReason
from kvtier.peer.server import PeerServer
from kvtier.testing.conformance import key_of
from kvtier.testing.fakes import FailingTier, LatencyTier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier
from tests.helpers.peer_helpers import REPO, TOKEN, peer_servers

BLOCK = 4096


def _block(i: int) -> np.ndarray:
    return np.full(BLOCK, i % 251, np.uint8)


def _reasons(store: TieredStore) -> dict[str, int]:
    return {r: n for r, n in store.stats()["miss_reasons"].items() if n}


async def test_dram_eviction_is_told_with_tier_policy_and_age() -> None:
    top = DRAMTier(capacity=4 * BLOCK, policy="arc", name="hot")
    low = DRAMTier(capacity=8 * BLOCK, name="warm")
    async with TieredStore([top, low]) as store:
        for i in range(20):
            await store.put(key_of(i), _block(i))
        assert await store.get(key_of(0)) is None
        assert _reasons(store) == {"evicted": 1}
        stats = store.stats()
        assert stats["tiers"][1]["miss_reasons"] == {"evicted": 1}  # the tier that dropped it
        assert stats["tiers"][0]["miss_reasons"] == {}
        [gone, demoted, fresh] = await store.explain([key_of(0), key_of(12), key_of(19)])
        assert gone.reason is MissReason.EVICTED and gone.reason_tier == 1
        assert gone.tiers[0].reason is MissReason.EVICTED and gone.tiers[0].detail == "arc"
        assert gone.tiers[1].detail == "lru" and gone.tiers[1].age_s is not None
        assert "evicted from tier 1 (warm) by lru" in str(gone)
        assert demoted.hit_tier == 1 and demoted.tiers[0].reason is MissReason.EVICTED
        assert fresh.hit_tier == 0 and fresh.reason is None and "HIT in tier 0 (hot)" in str(fresh)


async def test_explain_is_read_only_no_recency_no_promotion() -> None:
    top = DRAMTier(capacity=4 * BLOCK)
    low = DRAMTier(capacity=64 * BLOCK)
    async with TieredStore([top, low]) as store:
        for i in range(10):
            await store.put(key_of(i), _block(i))
        order_top, order_low = top.resident_keys(), low.resident_keys()
        found = await store.explain([key_of(0), key_of(6), key_of(9)])
        assert [e.hit_tier for e in found] == [1, 0, 0]
        assert top.resident_keys() == order_top and low.resident_keys() == order_low
        assert not await top.contains(key_of(0))  # not promoted
        assert store.stats()["gets"] == 0 and _reasons(store) == {}


async def test_namespace_mismatch_is_not_stored() -> None:
    tokens = list(range(64))
    mine = prefix_keys(tokens, 16, KeyNamespace(model="m", dtype="bf16"))
    theirs = prefix_keys(tokens, 16, KeyNamespace(model="m", dtype="fp16"))
    async with TieredStore([DRAMTier(capacity=1 << 20)]) as store:
        await store.put_many([(k, _block(i)) for i, k in enumerate(mine)])
        assert all(b is None for b in await store.get_many(theirs))
        assert _reasons(store) == {"not_stored": 4}
        assert await store.lookup_prefix(theirs) == 0
        assert store.stats()["lookup_miss_reasons"]["not_stored"] == 1
        [e] = await store.explain(theirs[:1])
        assert e.reason is MissReason.NOT_STORED and e.reason_tier is None
        assert "never stored under this namespace" in str(e)


async def test_deleted_key_is_told_as_deleted() -> None:
    async with TieredStore([DRAMTier(capacity=1 << 20), DRAMTier(capacity=1 << 20)]) as store:
        await store.put(key_of(1), _block(1))
        assert await store.delete(key_of(1))
        assert await store.get(key_of(1)) is None
        assert _reasons(store) == {"deleted": 1}
        [e] = await store.explain([key_of(1)])
        assert e.reason is MissReason.DELETED and e.reason_tier == 0
        assert "deleted from tier 0 (dram)" in str(e)
        await store.put(key_of(1), _block(1))  # stored again: a hit, whatever was noted
        assert (await store.explain([key_of(1)]))[0].hit_tier == 0


async def test_lmdb_eviction_and_corrupt_frame(tmp_path: Path) -> None:
    lmdb_tier = LMDBTier(tmp_path / "db", capacity=4 * (BLOCK + 256))
    async with TieredStore([DRAMTier(capacity=2 * BLOCK), lmdb_tier]) as store:
        for i in range(12):
            await store.put(key_of(i), _block(i))
        assert await store.get(key_of(0)) is None
        assert _reasons(store) == {"evicted": 1}
        [e] = await store.explain([key_of(0)])
        assert e.reason_tier == 1 and e.tiers[1].detail == "lru"
        held = [i for i in range(12) if await lmdb_tier.contains(key_of(i))]
        victim = key_of(held[0])
        env = lmdb_tier._env
        assert env is not None
        with env.env.begin(write=True) as txn:  # flip one payload byte behind the tier's back
            raw = bytearray(txn.get(victim, db=env.payload))
            raw[100] ^= 0xFF
            txn.put(victim, bytes(raw), db=env.payload)
        assert await store.get(victim) is None
        assert _reasons(store) == {"evicted": 1, "corrupt": 1}
        [e] = await store.explain([victim])
        assert e.reason is MissReason.CORRUPT and e.reason_tier == 1
        assert "checksum" in e.tiers[1].detail and "corrupt" in str(e)


async def test_file_tier_corrupt_frame_on_disk(tmp_path: Path) -> None:
    file_tier = FsspecTier(f"file://{tmp_path}/kv")
    async with TieredStore([DRAMTier(capacity=1 << 20), file_tier]) as store:
        await file_tier.put(key_of(1), _block(1))
        path = Path(file_tier.path_of(key_of(1)))
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x40
        path.write_bytes(bytes(raw))
        [before] = await store.explain([key_of(1)])
        assert before.hit_tier == 1  # present on disk: explain does not read it
        assert await store.get_many([key_of(1)]) == [None]
        stats = store.stats()
        assert stats["miss_reasons"]["corrupt"] == 1
        assert stats["tiers"][1]["miss_reasons"] == {"corrupt": 1}
        [after] = await store.explain([key_of(1)])
        assert after.reason is MissReason.CORRUPT and "checksum" in after.tiers[1].detail


async def test_peer_owner_down_is_unavailable() -> None:
    async with peer_servers(1) as [server]:
        member = server.member_id
        url = f"peers://{member}?token={TOKEN}&replicas=1&timeout=0.5&health_interval=30"
        async with open_store([url]) as store:
            await store.put(key_of(1), _block(1))
            assert await store.get(key_of(1)) is not None
            await server.stop()
            assert await store.get(key_of(1)) is None
            assert await store.get(key_of(2)) is None  # the member is now known down
            assert _reasons(store) == {"unavailable": 2}
            assert store.stats()["tiers"][0]["miss_reasons"] == {"unavailable": 2}
            [e] = await store.explain([key_of(1)])
            assert e.reason is MissReason.UNAVAILABLE and e.reason_tier == 0
            assert "did not answer" in str(e) and member in str(e)


async def test_peer_owner_timed_out_is_unavailable() -> None:
    slow = PeerServer(LatencyTier(DRAMTier(), delay=1.0), token=TOKEN, close_segment=True)
    await slow.start()
    try:
        url = f"peers://{slow.member_id}?token={TOKEN}&replicas=1&timeout=0.2&health_interval=30"
        async with open_store(["dram://?capacity=1MiB", url]) as store:
            assert await store.get(key_of(5)) is None
            assert _reasons(store) == {"unavailable": 1}
            assert store.stats()["tiers"][1]["miss_reasons"] == {"unavailable": 1}
    finally:
        await slow.stop()


async def test_deadline_too_short_for_a_slow_tier() -> None:
    # Five times the deadlines below; the deadline's timer is due first whatever the load.
    slow = LatencyTier(DRAMTier(), delay=0.25, name="slow")
    async with TieredStore([DRAMTier(capacity=1 << 20), slow]) as store:
        await slow.put(key_of(1), _block(1))
        await slow.put(key_of(2), _block(2))
        assert await store.get(key_of(1), timeout=0.05) is None
        out = np.empty(BLOCK, np.uint8)
        assert await store.get_many_into([key_of(2)], [out], timeout=0.05) == [False]
        assert _reasons(store) == {"deadline": 2}
        assert store.stats()["tiers"][1]["miss_reasons"] == {"deadline": 2}
        [e] = await store.explain([key_of(1)], timeout=0.05)
        assert e.reason is MissReason.DEADLINE and "slow" in str(e)
        assert str(e).splitlines()[0].endswith("the call's deadline ran out before slow "
                                               "answered")
        assert await store.get(key_of(1)) is not None  # no deadline: served


async def test_failing_tier_is_unavailable_with_its_error() -> None:
    failing = FailingTier(DRAMTier(), fail={"get", "contains"}, name="flaky")
    async with TieredStore([DRAMTier(capacity=1 << 20), failing]) as store:
        assert await store.get(key_of(1)) is None
        assert _reasons(store) == {"unavailable": 1}
        [e] = await store.explain([key_of(1)])
        assert e.reason is MissReason.UNAVAILABLE and "injected" in e.tiers[1].detail


async def test_transient_reason_does_not_stick(tmp_path: Path) -> None:
    failing = FailingTier(DRAMTier(), fail={"get"}, name="flaky")
    async with TieredStore([DRAMTier(capacity=1 << 20), failing]) as store:
        assert await store.get(key_of(1)) is None
        failing.fail = set()
        assert await store.get(key_of(1)) is None
        assert _reasons(store) == {"unavailable": 1, "not_stored": 1}


async def test_records_are_bounded() -> None:
    async with TieredStore([DRAMTier(capacity=2 * BLOCK), DRAMTier(capacity=2 * BLOCK)],
                           miss_record_size=8) as store:
        for i in range(200):
            await store.put(key_of(i), _block(i))
        assert store.stats()["miss_records"] == 16
        assert await store.get(key_of(0)) is None  # forgotten: no record left
        assert _reasons(store) == {"not_stored": 1}
    with pytest.raises(ValueError, match="miss_record_size"):
        TieredStore([DRAMTier()], miss_record_size=0)


def test_blocking_store_explain() -> None:
    with BlockingStore(["dram://?capacity=1MiB"]) as store:
        store.put(key_of(1), _block(1))
        found = store.explain([key_of(1), key_of(2)])
        assert all(isinstance(e, Explanation) for e in found)
        assert [e.hit for e in found] == [True, False]
        assert found[1].as_dict()["reason"] == "not_stored"


async def test_metrics_carry_miss_reasons() -> None:
    segment = TieredStore([DRAMTier(capacity=1 << 20)])
    server = PeerServer(segment, token=TOKEN, close_segment=True)
    await server.start()
    try:
        assert await segment.get(key_of(1)) is None
        text = server.metrics_text()
        assert 'kvtier_store_misses_by_reason_total{op="get",reason="not_stored"} 1.0' in text
        assert 'kvtier_store_misses_by_reason_total{op="lookup",reason="evicted"} 0.0' in text
    finally:
        await server.stop()


# ------------------------------------------------------------------ kvtier explain
BLOCK_TOKENS = 16
NS = ["--model", "m", "--dtype", "bf16", "--block-tokens", str(BLOCK_TOKENS)]


def _partly_cached(tmp_path: Path) -> tuple[str, Path, list[bytes]]:
    """A file:// tier holding the first 3 of a 6-block prompt's blocks."""
    tokens = list(range(1000, 1000 + 6 * BLOCK_TOKENS + 5))
    keys = prefix_keys(tokens, BLOCK_TOKENS, KeyNamespace(model="m", dtype="bf16"))
    url = f"file://{tmp_path}/kv"
    with BlockingStore([url]) as store:
        store.put_many([(k, _block(i)) for i, k in enumerate(keys[:3])])
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text(json.dumps(tokens))
    return url, tokens_file, keys


def test_cli_prefix_of_partly_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, tokens_file, keys = _partly_cached(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "explain", "dram://?capacity=1MiB", url,
         "--prefix-of", str(tokens_file), *NS],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{keys[0].hex()}  HIT in tier 1 (file)" in out
    assert f"{keys[3].hex()}  MISS (not_stored)" in out
    assert "6 keys: 3 held, 3 missing (not_stored 3); the prompt's first 3 of 6 blocks " \
           "would hit" in out
    # Another namespace: nothing hits.
    tokens_file.write_text(" ".join(str(t) for t in json.loads(tokens_file.read_text())))
    assert main(["explain", url, "--prefix-of", str(tokens_file), "--model", "other",
                 "--block-tokens", str(BLOCK_TOKENS), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["reason"] for d in doc] == ["not_stored"] * 6
    assert main(["explain", url, "--key", keys[1].hex()]) == 0
    assert "HIT in tier 0 (file)" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--key", "XYZ"], "--key: expected lowercase hex"),
    (["--prefix-of", "/nonexistent/tokens", "--block-tokens", "16", "--model", "m"],
     "cannot read '/nonexistent/tokens'"),
    (["--prefix-of", "BADJSON", "--block-tokens", "16", "--model", "m"],
     "expected integer token ids"),
    (["--prefix-of", "TOKENS", "--block-tokens", "16", "--model", "m", "--tp-rank", "3"],
     "key namespace: tp_rank/tp_size"),
    (["--prefix-of", "TOKENS"], "--block-tokens: required"),
    (["--prefix-of", "TOKENS", "--block-tokens", "16"], "--model: required"),
    (["--prefix-of", "WORDS", "--block-tokens", "16", "--model", "m"],
     "expected integer token ids"),
    (["--prefix-of", "TOKENS", "--block-tokens", "4096", "--model", "m"], "no full block"),
    (["--key", "00" * 16, "--timeout", "0"], "--timeout: expected seconds > 0"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          argv: list[str], message: str) -> None:
    (tmp_path / "tokens").write_text("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]")
    (tmp_path / "words").write_text("1 2 three")
    (tmp_path / "bad.json").write_text("[1, 2,")
    files = {"TOKENS": "tokens", "WORDS": "words", "BADJSON": "bad.json"}
    argv = [str(tmp_path / files[a]) if a in files else a for a in argv]
    assert main(["explain", "dram://", *argv]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kvtier explain: ") and message in out and out.count("\n") == 1


def test_cli_bad_url_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "nosuch://x", "--key", "00" * 16]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kvtier explain: ") and out.count("\n") == 1
