"""Property: under random faults (stop, kill, slow, partition) of real `kvtier serve`
members, no stored block is ever explained ``not_stored`` while an owner of it is
unreachable, from the writer or from a fresh client; a block every owner of which is
unreachable is ``unavailable`` naming one of them; a never-stored key whose owners all
answer is ``not_stored``.

A seeded random schedule (bounded: ``ROUNDS`` rounds of one or two faults), each member
behind a :class:`FaultProxy` (slow and partition) and signalled (stop and kill). Set
``KVTIER_FAULT_SEED`` to replay or widen a schedule.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvtier import TieredStore, open_store
from kvtier.misses import MissReason
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.peer_helpers import ServeProcess, pool_url, serve_processes

pytestmark = pytest.mark.slow

MEMBERS = 4
ROUNDS = 4
BLOCKS = 24
ABSENT = 12
TIMEOUT = 1.0
FAULTS = ("stop", "kill", "slow", "partition")
SEED = int(os.environ.get("KVTIER_FAULT_SEED", "1"))


class Pool:
    """The serve processes, their proxies, and the faults applied now."""

    def __init__(self, procs: list[ServeProcess], proxies: list[FaultProxy]) -> None:
        self.procs, self.proxies = procs, proxies
        self.faults: dict[int, str] = {}

    @property
    def members(self) -> list[str]:
        return [p.member for p in self.proxies]

    def apply(self, index: int, fault: str) -> None:
        self.faults[index] = fault
        if fault == "stop":
            self.procs[index].signal(signal.SIGSTOP)
        elif fault == "kill":
            self.procs[index].signal(signal.SIGKILL)
            assert self.procs[index].proc is not None
            self.procs[index].proc.wait(10)
        elif fault == "slow":
            self.proxies[index].set("slow", TIMEOUT * 3)  # slower than the pool's timeout
        else:
            self.proxies[index].set("partition")

    def heal(self) -> None:
        for index, fault in self.faults.items():
            proc = self.procs[index]
            if fault == "stop":
                proc.signal(signal.SIGCONT)
            elif fault == "kill":
                port = proc.member.rpartition(":")[2]
                proc.proc = None
                proc.start(f"127.0.0.1:{port}")
            self.proxies[index].set("pass")
        self.faults = {}

    @property
    def unreachable(self) -> set[str]:
        return {self.proxies[i].member for i in self.faults}


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    with serve_processes(tmp_path, MEMBERS, ["--tier", "dram://?capacity=64MiB"]) as procs:
        proxies = [FaultProxy(p.member) for p in procs]
        for proxy in proxies:
            await proxy.start()
        try:
            yield Pool(procs, proxies)
        finally:
            for proxy in proxies:
                await proxy.close()


def _owners(store: TieredStore, key: bytes, replicas: int) -> list[str]:
    return store.tiers[0].members.ring.owners(key, replicas)  # type: ignore[attr-defined,no-any-return]


async def _check(store: TieredStore, stored: list[bytes], absent: list[bytes], replicas: int,
                 down: set[str], label: str) -> None:
    blocks = await store.get_many(stored)
    assert store.stats()["miss_reasons"]["not_stored"] == 0, (label, store.stats())
    found = await store.explain(stored + absent)
    for key, block, e in zip(stored, blocks, found, strict=False):
        owners = _owners(store, key, replicas)
        where = f"{label}: {key.hex()} owners {owners} down {sorted(down)}: {e}"
        if block is not None:
            continue
        assert e.reason is not MissReason.NOT_STORED, where
        if set(owners) <= down:
            assert not e.hit and e.reason is MissReason.UNAVAILABLE, where
            assert any(m in e.summary() for m in owners), where
    for key, e in zip(absent, found[len(stored):], strict=True):
        owners = _owners(store, key, replicas)
        where = f"{label}: absent {key.hex()} owners {owners} down {sorted(down)}: {e}"
        if set(owners) & down:
            assert e.reason is MissReason.UNAVAILABLE, where
        else:
            assert e.reason is MissReason.NOT_STORED, where


async def test_no_stored_block_is_not_stored_while_an_owner_is_unreachable(pool: Pool) -> None:
    rng = random.Random(SEED)
    for round_ in range(ROUNDS):
        replicas = rng.choice((1, 2))
        faulted = rng.sample(range(MEMBERS), rng.choice((1, 2)))
        faults = {i: rng.choice(FAULTS) for i in faulted}
        label = f"seed {SEED} round {round_} replicas {replicas} faults " + \
            ", ".join(f"{pool.members[i]}={f}" for i, f in faults.items())
        url = pool_url(pool.members, replicas=replicas, timeout=TIMEOUT, health_interval=30)
        base = 100_000 * (round_ + 1)
        stored = [key_of(base + i) for i in range(BLOCKS)]
        absent = [key_of(base + 50_000 + i) for i in range(ABSENT)]
        async with open_store([url]) as writer:
            await writer.put_many([(k, sample_block(i)) for i, k in enumerate(stored)])
            for index, fault in faults.items():
                pool.apply(index, fault)
            try:
                await _check(writer, stored, absent, replicas, pool.unreachable,
                             f"{label} (writer)")
                async with open_store([url]) as fresh:
                    await _check(fresh, stored, absent, replicas, pool.unreachable,
                                 f"{label} (fresh client)")
            finally:
                pool.heal()
