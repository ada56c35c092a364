"""``placement=local``: blocks stay on the member that computed them, the holder directory
finds them from anywhere, and an evicted last copy moves by global age. The tier
conformance suite against in-process servers with their holders; the directory and the
forwarding against real `kvtier serve` processes."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import BlockingStore
from kvtier.errors import ConfigError
from kvtier.peer.holder import LocalHolder
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import TierConformance, key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.base import Tier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN, SlowSegments, pool_processes, pool_url

BLOCK = sample_block(0).nbytes  # 1 KiB


class TestLocalConformance(SlowSegments, TierConformance):
    """The tier contract through a ``placement=local`` client of three servers."""

    bounded = False

    @pytest.fixture(autouse=True)
    async def _servers(self) -> AsyncIterator[None]:
        self.servers: list[PeerServer] = []
        self.pools: list[PeerTier] = []
        yield
        for pool in self.pools:
            await pool.aclose()
        for server in self.servers:
            await server.stop()

    async def make_tier(self, capacity: int | None) -> Tier:
        if not self.servers:
            for _ in range(3):
                server = PeerServer(LatencyTier(DRAMTier(), delay=0.0), token=TOKEN,
                                    close_segment=True)
                await server.start()
                self.servers.append(server)
            members = [s.member_id for s in self.servers]
            for server in self.servers:
                pool = PeerTier.from_url(pool_url(members, placement="local"),
                                         self=server.member_id, local=server.segment)
                LocalHolder(server, pool).attach()
                await pool.open()
                self.pools.append(pool)
        members = [s.member_id for s in self.servers]
        return PeerTier.from_url(pool_url(members, placement="local", home=members[1]))


def test_home_needs_placement_local_and_a_member() -> None:
    with pytest.raises(ConfigError, match="only with placement=local"):
        PeerTier.from_url("peers://127.0.0.1:1?home=127.0.0.1:1")
    with pytest.raises(ConfigError, match="not one of the members"):
        PeerTier.from_url("peers://127.0.0.1:1?placement=local&home=127.0.0.1:2")
    with pytest.raises(ConfigError, match="needs home="):
        PeerTier.from_url("peers+dns://kvtier.example:7070?placement=local")
    tier = PeerTier.from_url("peers://127.0.0.1:1,127.0.0.1:2?placement=local")
    assert tier.stats()["home"] == "127.0.0.1:1"  # the first member by default


# ---------------------------------------------------------------- real kvtier serve
def _client(members: list[str], home: str, **opts: object) -> BlockingStore:
    return BlockingStore([pool_url(members, **{"placement": "local", "home": home,
                                               "timeout": 5, "health_interval": 30, **opts})])


def _metric(member: str, name: str) -> float:
    """A ``kvtier_peer_local_*`` figure of ``member``'s ``/metrics``."""
    req = urllib.request.Request(f"http://{member}/metrics",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^kvtier_peer_local_{name}(?:_total)? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _held(member: str, keys: list[bytes]) -> list[bool]:
    with BlockingStore([pool_url([member], timeout=5)]) as one:
        return [one.contains(k) for k in keys]


def _dram(blocks: int) -> list[str]:
    return ["--tier", f"dram://?capacity={blocks * BLOCK}", "--policy", "lru"]


def _written_keys_owned_by_member_1(members: list[str], ids: range) -> list[bytes]:
    """40 keys of ``ids`` whose directory entries member 1 keeps, written through member 0
    (block ``sample_block(i)`` for the i-th)."""
    ring = PeerTier.from_url(pool_url(members)).members.ring
    keys = [k for k in map(key_of, ids) if ring.primary(k) == members[1]][:40]
    with _client(members, members[0]) as writer:
        writer.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
    return keys


POOL = {"placement": "local", "health_interval": 0.1, "timeout": 5}


@pytest.mark.slow
def test_a_block_evicted_on_a_is_read_from_b(tmp_path: Path) -> None:
    """A member's DRAM evicts a last copy: it moves to a member with room (older than
    anything A holds), leaves A, and a fresh client reads it from there."""
    with pool_processes(tmp_path, 2, lambda i: _dram(20 if i == 0 else 200), POOL) as (
            procs, _):
        a, b = [p.member for p in procs]
        time.sleep(0.5)  # each member's health probes see the other's room
        keys = [key_of(i) for i in range(60)]
        with _client([a, b], a) as writer:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        on_a, on_b = _held(a, keys), _held(b, keys)
        assert sum(on_a) <= 20 < sum(on_b)
        assert all(x or y for x, y in zip(on_a, on_b, strict=True))
        assert _metric(a, "forwarded") >= 40
        with _client([a, b], a) as fresh:
            got = fresh.get_many(keys)
            assert all(g is not None and np.array_equal(g, sample_block(i))
                       for i, g in enumerate(got))
            assert fresh.stats()["tiers"][0]["remote_hits"] >= 40


@pytest.mark.slow
def test_the_last_copy_survives_an_eviction_storm(tmp_path: Path) -> None:
    """Three members of 40 blocks each; one client writes 110 blocks through one home
    (four times its room): every block is still held somewhere and reads back right,
    because each eviction forwarded its last copy to an older member while one had room."""
    with pool_processes(tmp_path, 3, lambda i: _dram(40), POOL) as (procs, _):
        members = [p.member for p in procs]
        time.sleep(0.5)
        keys = [key_of(1000 + i) for i in range(110)]
        with _client(members, members[0]) as writer:
            for start in range(0, len(keys), 10):
                writer.put_many([(k, sample_block(start + i))
                                 for i, k in enumerate(keys[start:start + 10])])
        held = [_held(m, keys) for m in members]
        assert all(any(h[i] for h in held) for i in range(len(keys)))
        with _client(members, members[2]) as fresh:
            got = fresh.get_many(keys)
        assert all(g is not None and np.array_equal(g, sample_block(i))
                   for i, g in enumerate(got))


@pytest.mark.slow
def test_no_copy_is_lost_when_two_members_forward_at_once(tmp_path: Path) -> None:
    """Two clients write at once through two small homes, each evicting and forwarding to
    the same roomy third member: every acked block is held and reads back right."""
    with pool_processes(tmp_path, 3, lambda i: _dram(300 if i == 2 else 30), POOL) as (
            procs, _):
        members = [p.member for p in procs]
        time.sleep(0.5)
        batches = {0: [key_of(2000 + i) for i in range(120)],
                   1: [key_of(3000 + i) for i in range(120)]}
        errors: list[BaseException] = []

        def write(home: int) -> None:
            try:
                with _client(members, members[home]) as writer:
                    keys = batches[home]
                    for start in range(0, len(keys), 6):
                        writer.put_many([(k, sample_block(start + i))
                                         for i, k in enumerate(keys[start:start + 6])])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(h,)) for h in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors
        assert _metric(members[0], "forwarded") > 0 < _metric(members[1], "forwarded")
        keys = batches[0] + batches[1]
        with _client(members, members[2]) as fresh:
            got = fresh.get_many(keys)
        want = [sample_block(i % 120) for i in range(len(keys))]
        assert all(g is not None and np.array_equal(g, w)
                   for g, w in zip(got, want, strict=True))


@pytest.mark.slow
def test_a_fresh_client_finds_blocks_through_the_directory_and_copies_hot_ones_home(
        tmp_path: Path) -> None:
    """Blocks written through one home are found by a client of another home with one
    directory lookup; what it reads a second time is copied to its own home, which serves
    the next read."""
    with pool_processes(tmp_path, 3, lambda i: _dram(1000), POOL) as (procs, _):
        members = [p.member for p in procs]
        keys = [key_of(4000 + i) for i in range(24)]
        with _client(members, members[0]) as writer:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        assert _held(members[0], keys) == [True] * 24
        assert _held(members[1], keys) == [False] * 24  # stored where it was computed
        with _client(members, members[1]) as reader:
            assert reader.lookup_prefix(keys) == 24
            got = reader.get_many(keys)
            assert all(np.array_equal(g, sample_block(i)) for i, g in enumerate(got))
            assert _held(members[1], keys) == [False] * 24  # read once: not copied
            reader.get_many(keys)  # read again from member 0: hot, copied home
            for _ in range(200):  # the copies home run in the background
                stats = reader.stats()["tiers"][0]
                if stats.get("local_copies", 0) >= 24:
                    break
                time.sleep(0.05)
            assert stats["remote_hits"] == 48 and stats["local_copies"] == 24
            # Routed by the holders it saw (no request): members 0 and 1 hold the prompt.
            assert reader.route(keys, [members[2], members[0]]) == members[0]
            assert reader.route(keys, members, {members[0]: 5}) == members[1]
        assert _held(members[1], keys) == [True] * 24
        with _client(members, members[1]) as again:
            again.get_many(keys)
            assert again.stats()["tiers"][0].get("remote_hits", 0) == 0


@pytest.mark.slow
def test_replicas_keep_directory_entries_and_last_copies_through_a_member_down(
        tmp_path: Path) -> None:
    """replicas=2: every block is written to its home and one more member, registered with
    two directory owners, and a home that evicts a block forwards it (one copy left is
    below replicas); with any one member stopped, a fresh client still reads every block."""
    opts = {**POOL, "replicas": 2}
    with pool_processes(tmp_path, 4, lambda i: _dram(30 if i == 0 else 400), opts) as (
            procs, _):
        members = [p.member for p in procs]
        time.sleep(0.5)
        keys = [key_of(5000 + i) for i in range(90)]
        with _client(members, members[0], replicas=2) as writer:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        # A home's eviction forwards the block after the put was acked: on a loaded box the
        # last forwards may still be in flight when the writer closes.
        for _ in range(40):
            held = [_held(m, keys) for m in members]
            short = [i for i in range(len(keys)) if sum(h[i] for h in held) < 2]
            if not short:
                break
            time.sleep(0.5)
        assert not short, f"{len(short)} of {len(keys)} blocks under 2 copies"
        assert _metric(members[0], "forwarded") >= 60
        for down in range(4):
            procs[down].signal(signal.SIGSTOP)  # frozen: a silent member, its DRAM kept
            try:
                with _client(members, members[(down + 1) % 4], replicas=2,
                             timeout=1) as fresh:
                    got = fresh.get_many(keys)
            finally:
                procs[down].signal(signal.SIGCONT)
            assert all(g is not None and np.array_equal(g, sample_block(i))
                       for i, g in enumerate(got)), f"member {down} down"


@pytest.mark.slow
def test_a_directory_owner_restarted_empty_is_refilled_by_the_holders(tmp_path: Path
                                                                      ) -> None:
    """The member that keeps the directory entries of some keys restarts empty: the
    holder's anti-entropy pass (a membership change) registers its blocks again, and a
    fresh client of a third home finds every one."""
    with pool_processes(tmp_path, 3, lambda i: _dram(1000), POOL) as (procs, _):
        members = [p.member for p in procs]
        keys = _written_keys_owned_by_member_1(members, range(6000, 6400))
        procs[1].stop()
        procs[1].launch(members[1])
        procs[1].wait_ready()
        for _ in range(100):  # until member 0 sees the restart and its pass re-registers
            if _metric(members[1], "directory_keys") >= len(keys):
                break
            time.sleep(0.1)
        with _client(members, members[2]) as fresh:
            got = fresh.get_many(keys)
        assert all(g is not None and np.array_equal(g, sample_block(i))
                   for i, g in enumerate(got))


@pytest.mark.slow
def test_a_directory_owner_that_leaves_is_replaced_by_the_next_member(tmp_path: Path
                                                                      ) -> None:
    """The directory owner of some keys stops for good: once the holder sees it gone, its
    anti-entropy pass registers its blocks with the keys' next live member, and a fresh
    client finds every one."""
    with pool_processes(tmp_path, 3, lambda i: _dram(1000), POOL) as (procs, _):
        members = [p.member for p in procs]
        keys = _written_keys_owned_by_member_1(members, range(7000, 7400))
        procs[1].stop()
        for _ in range(100):  # until member 0's pass registered them elsewhere
            if _metric(members[2], "directory_keys") + _metric(members[0],
                                                               "directory_keys") >= 40:
                break
            time.sleep(0.1)
        with _client(members, members[2], fail_after=1) as fresh:
            got = fresh.get_many(keys)
        assert all(g is not None and np.array_equal(g, sample_block(i))
                   for i, g in enumerate(got))
