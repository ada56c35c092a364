"""The four data-loss repros of chain placement (issue 29), against real `kvtier serve`
processes under the placements that remain. Chain placement (``placement=anchor:R``) made a
block's owner depend on what each process had seen of its chain; it was removed, and a URL
naming it fails at open. Every test here failed under ``placement=anchor:R``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import BlockingStore
from kvtier.errors import ConfigError
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import TOKEN, ServeProcess, free_members, pool_processes, token_file

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

PLACEMENTS = ["block", "local"]
DRAM = ["--tier", "dram://"]


def _url(members: list[str], placement: str, **opts: object) -> str:
    if placement != "local":
        opts.pop("home", None)  # the member a placement=local client writes to
    query = "&".join(f"{k}={v}" for k, v in
                     {"token": TOKEN, "timeout": 5, "health_interval": 30,
                      "placement": placement, **opts}.items())
    return f"peers://{','.join(members)}?{query}"


def _chain(index: int, length: int) -> list[bytes]:
    return [key_of(index * 100 + i) for i in range(length)]


@pytest.fixture(scope="module", params=PLACEMENTS)
def pool(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], str]]:
    """4 `kvtier serve` DRAM servers under one placement, as ``(members, placement)``: shared
    by the repros that only read and write blocks (starting 4 processes per test was most of
    this module's time). Each test uses its own chain indices, so no test finds blocks
    another one stored."""
    placement: str = request.param
    with pool_processes(tmp_path_factory.mktemp("pool"), 4, lambda i: DRAM,
                        {"placement": placement}) as (procs, _):
        yield [p.member for p in procs], placement


def _same(got: object, i: int) -> bool:
    return got is not None and np.array_equal(got, sample_block(i))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["anchor:3", "anchor:1:4", "chunk:2", "root:1"])
def test_a_chain_placement_url_fails_at_open_and_names_the_alternatives(mode: str) -> None:
    with pytest.raises(ConfigError, match="chain placement was removed") as info:
        PeerTier.from_url(f"peers://127.0.0.1:1?placement={mode}")
    assert "placement=local" in str(info.value) and "placement=block" in str(info.value)


def test_chains_extended_with_a_parent_are_found_by_writer_and_fresh_client(
        pool: tuple[list[str], str]) -> None:
    """Repro 1: 4 servers, turn 1 stores 2 blocks, turn 2 four more after ``parent=``; every
    extended chain is found whole (under anchor:3, 6 of 8 were found 0/6)."""
    members, placement = pool
    url = _url(members, placement, home=members[0])
    chains = [_chain(c, 6) for c in range(8)]
    with BlockingStore([url]) as writer:
        for chain in chains:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(chain[:2])])
        for chain in chains:
            writer.put_many([(k, sample_block(i + 2)) for i, k in enumerate(chain[2:])],
                            parent=chain[1])
        assert [writer.lookup_prefix(c) for c in chains] == [6] * 8
    with BlockingStore([_url(members, placement, home=members[2])]) as fresh:
        assert [fresh.lookup_prefix(c) for c in chains] == [6] * 8


def test_mid_chain_slices_are_found_by_a_fresh_client(pool: tuple[list[str], str]) -> None:
    """Repro 2: a slice ``chain[4:8]`` read or written without ``parent`` by a process that
    never saw the whole prompt (the vLLM worker's loads and saves) finds and places its
    blocks as every other client does (under anchor:1, 12-20 of 32 were missed)."""
    members, placement = pool
    chains = [_chain(c, 8) for c in range(20, 28)]
    with BlockingStore([_url(members, placement, home=members[0])]) as writer:
        for chain in chains:
            writer.put_many([(k, sample_block(i)) for i, k in enumerate(chain)])
    with BlockingStore([_url(members, placement, home=members[1])]) as fresh:
        for chain in chains:
            got = fresh.get_many(chain[4:8])
            assert all(_same(b, i + 4) for i, b in enumerate(got))
    slices = [_chain(c, 8) for c in range(30, 38)]
    with BlockingStore([_url(members, placement, home=members[2])]) as head:
        for chain in slices:
            head.put_many([(k, sample_block(i)) for i, k in enumerate(chain[:4])])
    with BlockingStore([_url(members, placement, home=members[3])]) as tail:
        for chain in slices:
            tail.put_many([(k, sample_block(i + 4)) for i, k in enumerate(chain[4:])])
    with BlockingStore([_url(members, placement, home=members[1])]) as reader:
        assert [reader.lookup_prefix(c) for c in slices] == [8] * 8


def test_explain_get_and_contains_agree_with_lookup_prefix_from_a_fresh_client(
        pool: tuple[list[str], str]) -> None:
    """Repro 4: a client that never saw the chain finds every block by ``get``, ``contains``
    and ``explain`` alike (under anchor:1, explain called 4 of 8 held blocks "never stored"
    while lookup_prefix found 8 of 8)."""
    members, placement = pool
    chain = _chain(43, 8)
    with BlockingStore([_url(members, placement, home=members[0])]) as writer:
        writer.put_many([(k, sample_block(i)) for i, k in enumerate(chain)])
    with BlockingStore([_url(members, placement, home=members[1])]) as fresh:
        assert [fresh.explain([k])[0].hit_tier for k in chain] == [0] * 8
        assert [fresh.contains(k) for k in chain] == [True] * 8
        assert all(_same(fresh.get(k), i) for i, k in enumerate(chain))
        assert fresh.lookup_prefix(chain) == 8


def _held_by_none(members: list[str], keys: list[bytes], placement: str) -> int:
    """How many ``keys`` a fresh client cannot read from the pool."""
    with BlockingStore([_url(members, placement, home=members[0], read_walk=len(members))]
                       ) as fresh:
        got = fresh.get_many(keys)
    return sum(1 for b in got if b is None)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_warm_restart_keeps_every_acked_copy(tmp_path: Path, placement: str) -> None:
    """Repro 3: 4 x ``[dram, lmdb]`` servers with ``--pool`` and replicas 2; one is stopped
    and restarted on its LMDB directory, then, once its anti-entropy ran, its co-owners are
    stopped one at a time: no acked block is held by no server (under anchor:1 the restart
    pruned its own copies as stand-ins and 4-9 acked blocks were lost)."""
    tokens = token_file(tmp_path)
    procs: list[ServeProcess] = []
    members = free_members(4)
    pool = _url(members, placement, replicas=2, health_interval=0.1, timeout=2)

    def launch(i: int) -> ServeProcess:
        proc = ServeProcess(["--tier", "dram://?capacity=64MiB",
                             "--tier", f"lmdb://{tmp_path / f'db{i}'}?capacity=256MiB",
                             "--pool", pool, "--repair-interval", "0.2"], tokens)
        proc.launch(members[i])
        return proc

    try:
        procs = [launch(i) for i in range(4)]
        for p in procs:
            p.wait_ready()
        keys = [key_of(5000 + i) for i in range(300)]
        with BlockingStore([_url(members, placement, replicas=2, home=members[0])]) as w:
            w.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        procs[1].stop()
        procs[1] = launch(1)
        procs[1].wait_ready()
        time.sleep(3)  # the members see it back; anti-entropy passes run
        for i in (2, 3):
            procs[i].stop()
            assert _held_by_none([m for j, m in enumerate(members) if j != i], keys,
                                 placement) == 0
            procs[i] = launch(i)
            procs[i].wait_ready()
            time.sleep(3)
    finally:
        for p in procs:
            p.stop()
