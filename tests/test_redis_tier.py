"""RedisTier against real redis-server processes on loopback (one server, and a cluster of
three primaries with one replica each): conformance, options, corrupt values, pins through
TTLs, kill/restart faults, a cluster failover, and the dram -> redis -> lmdb chain machine."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvtier.errors import ConfigError, TierError
from kvtier.store import TieredStore, open_store
from kvtier.testing.chain import make_chain_machine
from kvtier.testing.conformance import SLOW_SECONDS, TierConformance, key_of, sample_block
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.registry import tier_from_url

redis_servers = pytest.importorskip("tests.helpers.redis_servers", reason="redis-py not installed")
if redis_servers.MISSING:
    pytest.skip(redis_servers.MISSING, allow_module_level=True)

import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from kvtier.tiers.redis_tier import RedisTier  # noqa: E402

_prefixes = itertools.count()


def _prefix() -> str:
    return f"t{time.monotonic_ns()}-{next(_prefixes)}:"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_servers.RedisServer]:
    srv = redis_servers.RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis_servers.RedisCluster]:
    c = redis_servers.RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


class _PausedServers(TierConformance):
    """The worker-thread cases against a slow server: ``CLIENT PAUSE`` holds every client's
    commands on each node for :data:`SLOW_SECONDS` (the commands arrive and wait, as on a
    busy server), then runs them in arrival order."""

    nodes: list[redis_servers.RedisServer]

    @contextlib.contextmanager
    def slow_backend(self, tier: Tier) -> Iterator[None]:
        for node in self.nodes:
            with redis.Redis(host=redis_servers.HOST, port=node.port) as admin:
                admin.execute_command("CLIENT", "PAUSE", int(SLOW_SECONDS * 1000), "ALL")
        self._paused_until = time.monotonic() + SLOW_SECONDS
        yield

    async def backend_idle(self, tier: Tier) -> None:
        await asyncio.sleep(max(0.0, self._paused_until - time.monotonic()))
        for node in self.nodes:  # answered after every command held by the pause
            client = aioredis.Redis(host=redis_servers.HOST, port=node.port)
            try:
                await client.ping()
            finally:
                await client.aclose()


class TestRedisConformance(_PausedServers):
    bounded = False  # the server's maxmemory-policy evicts, not the tier

    @pytest.fixture(autouse=True)
    def _server(self, server: redis_servers.RedisServer) -> None:
        self.url = f"redis://{server.address}/0?timeout=5"
        self.nodes = [server]

    async def make_tier(self, capacity: int | None) -> Tier:
        return tier_from_url(self.url, prefix=_prefix())


class TestRedisClusterConformance(_PausedServers):
    bounded = False

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: redis_servers.RedisCluster) -> None:
        self.url = f"redis+cluster://{cluster.url_hosts}?timeout=5"
        self.nodes = cluster.nodes

    async def make_tier(self, capacity: int | None) -> Tier:
        return tier_from_url(self.url, prefix=_prefix())


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(("url", "message"), [
    ("redis://h:1,h:2", "redis\\+cluster"),
    ("redis://h:notaport", "host:port"),
    ("redis://h:1/x", "database"),
    ("redis+cluster://h:1/3", "database 0"),
    ("redis://user:pw@h:1", "token=env"),
    ("redis://h:1?ttl=-1", "ttl"),
    ("redis://h:1?timeout=0", "timeout"),
    ("redis://h:1?max_connections=zero", "max_connections"),
    ("redis://h:1?tls=maybe", "tls"),
    ("redis://h:1?tls_ca=/ca.pem", "tls_ca"),
    ("redis://h:1?colour=red", "colour"),
    ("redis://h:1?token=env:KVTIER_TEST_UNSET_VAR", "KVTIER_TEST_UNSET_VAR"),
])
def test_bad_urls_rejected(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tier_from_url(url)


async def test_a_tier_that_fails_to_pin_is_counted_not_raised() -> None:
    """Store pins are hints about eviction: a tier's failure is counted and logged (the
    other tiers still pin), unlike a put's (``docs/architecture.md``, Pins)."""
    dead = f"{redis_servers.HOST}:{redis_servers._free_port(False)}"  # nothing listens
    dram = DRAMTier(1 << 20)
    store = TieredStore([dram, tier_from_url(f"redis://{dead}/0?ttl=60&timeout=0.5")])
    await store.pin([key_of(1)])
    assert dram._policy.is_pinned(key_of(1))
    assert store.stats()["tiers"][1]["errors"] == 1
    await store.unpin([key_of(1)])
    assert not dram._policy.is_pinned(key_of(1))
    await store.aclose()


async def test_url_options_reach_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_REDIS_PW", "s3cret-pw")
    tier = tier_from_url("redis://127.0.0.1:6390/2?prefix=p:&ttl=60&max_connections=7"
                         "&token=env:KVTIER_TEST_REDIS_PW&timeout=0.25")
    assert isinstance(tier, RedisTier) and not tier.cluster
    kwargs = tier.client.connection_pool.connection_kwargs  # type: ignore[union-attr]
    assert (kwargs["db"], kwargs["password"], kwargs["socket_timeout"]) == (2, "s3cret-pw", 0.25)
    assert tier.client.connection_pool.max_connections == 7  # type: ignore[union-attr]
    assert (tier.prefix, tier.ttl) == (b"p:", 60)
    assert "s3cret-pw" not in repr(tier) + repr(tier.stats())
    await tier.aclose()


async def test_password_auth_with_acl_user(server: redis_servers.RedisServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with server.client() as admin:
        admin.acl_setuser("kvt-test", enabled=True, passwords=["+right-pw"],
                          keys=["*"], commands=["+@all"])
    monkeypatch.setenv("KVTIER_TEST_REDIS_PW", "right-pw")
    base = f"redis://{server.address}?username=kvt-test&prefix={_prefix()}&token="
    async with tier_from_url(base + "env:KVTIER_TEST_REDIS_PW") as good:
        await good.put(key_of(1), sample_block(1))
        assert await good.contains(key_of(1))
    async with tier_from_url(base + "wrong-pw") as bad:
        with pytest.raises(TierError, match="put failed") as info:
            await bad.put(key_of(2), sample_block(2))
        assert "wrong-pw" not in str(info.value)


async def test_wrong_password_fails_at_open(server: redis_servers.RedisServer,
                                            caplog: pytest.LogCaptureFixture) -> None:
    with server.client() as admin:
        admin.acl_setuser("kvt-open", enabled=True, passwords=["+right-pw"],
                          keys=["*"], commands=["+@all"])
        admin.acl_setuser("kvt-reader", enabled=True, passwords=["+read-pw"],
                          keys=["*"], commands=["+get", "+mget", "+exists", "+info"])
    base = f"redis://{server.address}?prefix={_prefix()}"
    with pytest.raises(ConfigError, match=r"refused a probe write.*token=") as info:
        await open_store([f"{base}&username=kvt-open&token=wrong-pw"])
    assert "wrong-pw" not in str(info.value)
    with pytest.raises(ConfigError, match="NoPermissionError"):  # may read, may not write
        await open_store([f"{base}&username=kvt-reader&token=read-pw"])
    async with open_store([f"{base}&username=kvt-open&token=right-pw"]) as store:
        await store.put(key_of(1), sample_block(1))
        with server.client() as admin:
            assert not admin.keys("*kvtier-probe*")  # the probe key is gone
    # A server that is not up yet is only logged: it is used once it answers.
    down = redis_servers.RedisServer(Path(tempfile.mkdtemp()))
    with caplog.at_level("WARNING", logger="kvtier.tiers.redis"):
        async with open_store([f"redis://{down.address}?timeout=0.5"]):
            pass
    assert "unreachable at open" in caplog.text


# ------------------------------------------------------------------- behaviour
async def test_corrupt_or_foreign_value_is_a_miss_and_dropped(
        server: redis_servers.RedisServer) -> None:
    prefix = _prefix()
    async with tier_from_url(f"redis://{server.address}?prefix={prefix}") as tier:
        assert isinstance(tier, RedisTier)
        await tier.put(key_of(1), sample_block(1))
        with server.client() as raw:
            frame = raw.get(prefix.encode() + key_of(1))
            assert frame is not None
            raw.set(prefix.encode() + key_of(1), frame[:-1])  # torn
            raw.set(prefix.encode() + key_of(2), b"someone else's value")  # foreign
        assert await tier.get_many([key_of(1), key_of(2)]) == [None, None]
        assert tier.stats()["corrupt"] == 2
        assert await tier.contains_many([key_of(1), key_of(2)]) == [False, False]


async def test_pool_visibility_between_tiers(server: redis_servers.RedisServer) -> None:
    url = f"redis://{server.address}?prefix={_prefix()}"
    async with tier_from_url(url) as writer, tier_from_url(url) as reader:
        block = sample_block(3, dtype="<f2").reshape(4, 128)
        await writer.put(key_of(3), block)
        got = await reader.get(key_of(3))
        assert got is not None and got.dtype == block.dtype and got.shape == block.shape
        assert got.tobytes() == block.tobytes()


async def test_pins_through_ttl(server: redis_servers.RedisServer) -> None:
    prefix = _prefix()
    rkey = prefix.encode() + key_of(1)
    async with tier_from_url(f"redis://{server.address}?prefix={prefix}&ttl=100") as tier:
        with server.client() as raw:
            await tier.put(key_of(1), sample_block(1))
            assert 0 < raw.ttl(rkey) <= 100
            await tier.pin([key_of(1)])
            await tier.pin([key_of(1)])
            assert raw.ttl(rkey) == -1  # PERSIST: no expiry, safe from volatile-lru
            await tier.put(key_of(1), sample_block(2))  # overwrite keeps the pin
            assert raw.ttl(rkey) == -1
            await tier.unpin([key_of(1)])
            assert raw.ttl(rkey) == -1  # still pinned once
            await tier.unpin([key_of(1)])
            assert 0 < raw.ttl(rkey) <= 100


async def test_lookup_prefix_counts_leading_hits(server: redis_servers.RedisServer) -> None:
    store = await open_store([f"redis://{server.address}?prefix={_prefix()}"])
    async with store:
        keys = [key_of(i) for i in range(6)]
        await store.put_many([(k, sample_block(i)) for i, k in enumerate(keys) if i != 4])
        assert await store.lookup_prefix(keys) == 4
        got = await store.get_many(keys[:4])
        assert all(g is not None and g.tobytes() == sample_block(i).tobytes()
                   for i, g in enumerate(got))
        tier = store.tiers[0]
        assert isinstance(tier, RedisTier)
        with server.client() as raw:  # the server evicts one between lookup and get
            raw.delete(tier.prefix + keys[2])
        got = await store.get_many(keys[:4])
        assert [g is None for g in got] == [False, False, True, False]


async def test_usage_from_info_memory(server: redis_servers.RedisServer) -> None:
    async with tier_from_url(f"redis://{server.address}?prefix={_prefix()}") as tier:
        assert isinstance(tier, RedisTier)
        await tier.refresh_usage()
        assert tier.capacity == 256 << 20  # the fixture's --maxmemory
        assert tier.used > 0


async def test_cluster_usage_sums_primaries(cluster: redis_servers.RedisCluster) -> None:
    async with tier_from_url(f"redis+cluster://{cluster.url_hosts}?prefix={_prefix()}") as tier:
        assert isinstance(tier, RedisTier)
        await tier.refresh_usage()
        assert tier.capacity == 3 * (256 << 20)
        assert tier.used > 0


# ----------------------------------------------------------------------- faults
async def test_server_killed_then_restarted(server: redis_servers.RedisServer) -> None:
    store = await open_store([f"redis://{server.address}?prefix={_prefix()}&timeout=0.5"])
    async with store:
        await store.put(key_of(1), sample_block(1))
        server.kill()
        try:
            assert await store.get(key_of(1)) is None  # a miss, not an exception
            assert await store.get_many([key_of(1), key_of(2)]) == [None, None]
            with pytest.raises(TierError, match="no tier accepted"):
                await store.put(key_of(2), sample_block(2))
            assert store.stats()["tiers"][0]["errors"] >= 3
        finally:
            server.start()  # same port, empty (no persistence)
        assert await store.get(key_of(1)) is None
        await store.put(key_of(2), sample_block(2))  # same store, no reopen
        got = await store.get(key_of(2))
        assert got is not None and got.tobytes() == sample_block(2).tobytes()


@pytest.mark.slow
async def test_cluster_failover(cluster: redis_servers.RedisCluster) -> None:
    prefix = _prefix()
    # 2 s per call: the client re-reads the cluster's slots when a node dies, and on a loaded
    # 2-core box that took longer than 0.5 s, failing every node's MGET of the batch.
    tier = tier_from_url(f"redis+cluster://{cluster.url_hosts}?prefix={prefix}&timeout=2")
    store = TieredStore(tiers=[tier])
    async with store:
        keys = [key_of(i) for i in range(24)]
        await store.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        victim = cluster.primary_of(prefix.encode() + keys[0])
        with victim.client() as c:  # the replica holds every write before the kill
            assert c.execute_command("WAIT", 1, 5000) >= 1
        on_victim = [k for k in keys if cluster.primary_of(prefix.encode() + k) is victim]
        elsewhere = [k for k in keys if k not in on_victim]
        assert on_victim and elsewhere
        victim.kill()
        try:
            # Other primaries keep serving in the same batch as the dead one's misses. Right
            # after the kill the client may spend a batch or two re-reading the slot map
            # (every node's MGET then fails; seen 2 in ~6 loaded full-suite runs): bounded.
            settle = time.monotonic() + 10
            while True:
                got = await store.get_many(keys)
                if all(got[i] is not None for i, k in enumerate(keys) if k in elsewhere) \
                        or time.monotonic() > settle:
                    break
                await asyncio.sleep(0.2)
            for i, (key, block) in enumerate(zip(keys, got, strict=True)):
                if key in elsewhere:
                    assert block is not None and block.tobytes() == sample_block(i).tobytes()
                else:  # the dead primary's keys: a miss until promotion, never wrong bytes
                    assert block is None or block.tobytes() == sample_block(i).tobytes()
            deadline = time.monotonic() + 30
            while (block := await store.get(on_victim[0])) is None:
                assert time.monotonic() < deadline, "replica was not promoted in 30 s"
                await asyncio.sleep(0.2)
            assert block.tobytes() == sample_block(keys.index(on_victim[0])).tobytes()
            got = await store.get_many(on_victim)
            assert [g.tobytes() if g is not None else None for g in got] == \
                [sample_block(keys.index(k)).tobytes() for k in on_victim]
        finally:
            victim.start()  # rejoins as a replica of its promoted one
            await asyncio.to_thread(cluster.wait_healthy, 60)


# ---------------------------------------------------------------- chain machine
_chain_server: dict[str, str] = {}
_chain_dirs: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _chain_url(server: redis_servers.RedisServer) -> None:
    _chain_server["url"] = f"redis://{server.address}?timeout=5"


def _chain() -> list[Tier]:
    tmp = tempfile.mkdtemp(prefix="kvtier-redis-chain-")
    _chain_dirs.append(tmp)
    return [DRAMTier(capacity=3 * 1024),
            RedisTier.from_url(_chain_server["url"], prefix=_prefix()),
            LMDBTier(Path(tmp) / "lmdb", capacity=16 * 1024)]


def _cleanup() -> None:
    while _chain_dirs:
        shutil.rmtree(_chain_dirs.pop(), ignore_errors=True)


TestRedisChain = make_chain_machine(
    _chain, block_sizes=(256, 1024), cleanup=_cleanup, settings=settings(
        max_examples=8, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])).TestCase


def test_schemes_are_built_in() -> None:
    from kvtier.tiers.registry import known_schemes, tier_class

    assert tier_class("redis") is RedisTier and tier_class("redis+cluster") is RedisTier
    assert {"redis", "redis+cluster"} <= set(known_schemes())


async def test_callers_beyond_max_connections_wait_for_one(
        server: redis_servers.RedisServer) -> None:
    async with tier_from_url(f"redis://{server.address}?prefix={_prefix()}"
                             "&max_connections=2&timeout=5") as tier:
        await tier.put(key_of(1), sample_block(1, nbytes=256 << 10))
        got = await asyncio.gather(*(tier.get(key_of(1)) for _ in range(12)))
        assert all(g is not None and g.tobytes() == sample_block(1, nbytes=256 << 10).tobytes()
                   for g in got)


async def test_put_many_repeated_key_last_value_wins(server: redis_servers.RedisServer) -> None:
    async with tier_from_url(f"redis://{server.address}?prefix={_prefix()}") as tier:
        big = 300 << 10  # over one pipeline's worth: the two writes go out concurrently
        await tier.put_many([(key_of(1), sample_block(1, nbytes=big)),
                             (key_of(2), sample_block(2, nbytes=big)),
                             (key_of(1), sample_block(3, nbytes=big))])
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(3, nbytes=big).tobytes()


@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_on_uvloop(kind: str, server: redis_servers.RedisServer,
                   cluster: redis_servers.RedisCluster) -> None:
    uvloop = pytest.importorskip("uvloop")
    url = f"redis://{server.address}" if kind == "single" else \
        f"redis+cluster://{cluster.url_hosts}"

    async def roundtrip() -> None:
        store = await open_store([f"{url}?prefix={_prefix()}&timeout=5"])
        async with store:
            await store.put_many([(key_of(i), sample_block(i)) for i in range(8)])
            got = await store.get_many([key_of(i) for i in range(8)])
            assert [g.tobytes() if g is not None else None for g in got] == \
                [sample_block(i).tobytes() for i in range(8)]

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(roundtrip())


async def test_tls_with_ca(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = (tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem")
    ca.cert_pem.write_to_path(str(files[0]))
    cert.cert_chain_pems[0].write_to_path(str(files[1]))
    cert.private_key_pem.write_to_path(str(files[2]))
    server = redis_servers.RedisServer(tmp_path / "tls", tls=files)
    await asyncio.to_thread(server.start)
    try:
        base = f"redis://{server.address}?prefix={_prefix()}&timeout=5"
        async with tier_from_url(f"{base}&tls=1&tls_ca={files[0]}") as tier:
            await tier.put(key_of(1), sample_block(1))
            got = await tier.get(key_of(1))
            assert got is not None and got.tobytes() == sample_block(1).tobytes()
        async with tier_from_url(base, timeout=0.5) as plain:  # no TLS: refused
            with pytest.raises(TierError):
                await plain.get(key_of(1))
        other_ca = tmp_path / "other-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(other_ca))
        async with tier_from_url(f"{base}&tls=1&tls_ca={other_ca}") as untrusted:
            with pytest.raises(TierError):
                await untrusted.get(key_of(1))
    finally:
        server.kill()
