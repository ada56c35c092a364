"""A router subscribed to a running ``kvtier serve`` learns what another process did to its
tier's directory (issue 31): ``kvtier gc`` run from another process, and an operator's
wipe, become ``BlockRemoved`` for each block that went and ``AllBlocksCleared`` for a tier
left empty, in the same incarnation and with no gap in the batch sequence.

Real processes: ``kvtier serve --events`` on an ``lmdb://`` and on a ``file://`` tier, a
ZMQ SUB socket decoding vLLM's wire format, blocks written over the pool protocol, and
``kvtier gc`` as a command in its own process.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvtier import open_store
from kvtier.codec import encode_frame
from kvtier.events_zmq import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventBatch,
)
from kvtier.store import TieredStore
from tests.helpers.peer_helpers import REPO, ServeProcess, pool_url, token_file

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

BLOCK = np.arange(4096, dtype=np.uint8)
FRAME = encode_frame(BLOCK).nbytes  # bytes on disk per block (both tiers, no zstd)
DECODER = msgspec.msgpack.Decoder(type=VllmKVEventBatch)
_EVENTS_RE = re.compile(r"kvtier serve events on (\S+)")
#: Generous: at load 8 a gc process takes seconds to import and run.
WAIT_S = 60.0


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


@dataclass
class Router:
    """What a router learns from the PUB socket: per tier, the keys held; every batch's
    sequence number and incarnation; every ``AllBlocksCleared``."""

    sock: zmq.asyncio.Socket
    held: dict[str, set[bytes]] = field(default_factory=dict)
    seqs: list[int] = field(default_factory=list)
    incarnations: set[str | None] = field(default_factory=set)
    cleared: list[VllmAllBlocksCleared] = field(default_factory=list)
    removed: set[bytes] = field(default_factory=set)

    async def pump(self, until: float) -> bool:
        """Apply one batch if one arrives before ``until`` (monotonic)."""
        left = until - time.monotonic()
        if left <= 0 or not await self.sock.poll(int(left * 1000)):
            return False
        _topic, seq, payload = await self.sock.recv_multipart()
        batch = DECODER.decode(payload)
        self.seqs.append(int.from_bytes(seq, "big"))
        self.incarnations.add(batch.incarnation)
        for event in batch.events:
            if isinstance(event, VllmBlockStored):
                self.held.setdefault(event.tier or "", set()).update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, VllmBlockRemoved):
                self.held.get(event.tier or "", set()).difference_update(event.block_hashes)
                self.removed.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, VllmAllBlocksCleared):
                self.cleared.append(event)
                if event.tier is None:
                    self.held.clear()
                else:
                    self.held.pop(event.tier, None)
        return True

    async def wait_for(self, what: str, done: object) -> None:
        end = time.monotonic() + WAIT_S
        while not done():  # type: ignore[operator]
            if not await self.pump(end) and time.monotonic() >= end:
                pytest.fail(f"timed out waiting for {what}; router holds "
                            f"{ {t: len(k) for t, k in self.held.items()} }, cleared "
                            f"{self.cleared}")


async def _serve(tmp: Path, tier_url: str) -> tuple[ServeProcess, str]:
    serve = ServeProcess(["--tier", tier_url, "--events", "tcp://127.0.0.1:0"],
                         token_file(tmp))
    await asyncio.to_thread(serve.start)
    found = _EVENTS_RE.search(serve.output())
    assert found, serve.output()
    return serve, found.group(1)


@asynccontextmanager
async def _router(endpoint: str) -> AsyncIterator[Router]:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        yield Router(sock)
    finally:
        sock.close()


async def _connected(router: Router, client: TieredStore, tier: str) -> None:
    """Put a first block until its ``BlockStored`` arrives (a SUB socket misses what was
    published before its subscription reached the publisher)."""
    end = time.monotonic() + WAIT_S
    while key(0) not in router.held.get(tier, set()):
        await client.put(key(0), BLOCK)
        await router.pump(min(end, time.monotonic() + 0.5))
        if time.monotonic() >= end:
            pytest.fail("no event reached the subscriber")


async def _gc(url: str, capacity: int) -> str:
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "kvtier.cli", "gc", url,
                         "--capacity", str(capacity)],
        cwd=REPO, capture_output=True, text=True, timeout=WAIT_S * 2)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


async def _still_held(client: TieredStore, keys: list[bytes]) -> set[bytes]:
    blocks = await client.get_many(keys)
    return {k for k, b in zip(keys, blocks, strict=True) if b is not None}


@pytest.mark.parametrize("scheme", ["lmdb", "file"])
async def test_gc_and_wipe_by_another_process_reach_the_router(tmp_path: Path,
                                                              scheme: str) -> None:
    root = tmp_path / "kv"
    url = f"{scheme}://{root}"
    serve, endpoint = await _serve(tmp_path, f"{url}?watch=0.1")
    try:
        async with _router(endpoint) as router:
            client = await open_store([pool_url([serve.member])])
            async with client:
                await _connected(router, client, scheme)
                first = [key(i) for i in range(1, 9)]
                await client.put_many([(k, BLOCK) for k in first])
                await router.wait_for("the first puts", lambda: set(first) <= router.held.get(
                    scheme, set()))

                # A partial gc: the router learns exactly which blocks went.
                out = await _gc(url, 4 * FRAME + FRAME // 2)
                await router.wait_for(f"removals after {out!r}",
                                      lambda: len(router.held.get(scheme, ())) == 4)
                assert not router.cleared
                kept = router.held[scheme]
                assert await _still_held(client, [key(0), *first]) == kept

                # gc to 0: every block removed by name, then the tier cleared.
                out = await _gc(url, 0)
                await router.wait_for(f"AllBlocksCleared after {out!r}",
                                      lambda: bool(router.cleared))
                assert [(c.tier, c.medium) for c in router.cleared] == [(scheme, "STORAGE")]
                assert kept <= router.removed
                assert await _still_held(client, list(kept)) == set()

                # An operator wipes the directory: the same.
                again = [key(i) for i in range(20, 24)]
                await client.put_many([(k, BLOCK) for k in again])
                await router.wait_for("puts after the gc", lambda: set(again) <= router.held.get(
                    scheme, set()))
                if scheme == "file":
                    for child in root.iterdir():
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
                else:
                    (root / "data.mdb").unlink()
                await router.wait_for("AllBlocksCleared after the wipe",
                                      lambda: len(router.cleared) == 2)
                assert router.cleared[1].tier == scheme and not router.held.get(scheme)
            # One incarnation, batches numbered without a gap (the first ones may have
            # gone out before the subscription reached the publisher).
            assert len(router.incarnations) == 1 and None not in router.incarnations
            assert router.seqs == list(range(router.seqs[0], router.seqs[0] + len(router.seqs)))
    finally:
        serve.stop()


def test_gc_trims_an_lmdb_directory_nobody_has_open(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main
    from kvtier.tiers.lmdb import LMDBTier

    async def fill() -> list[bytes]:
        tier = LMDBTier(tmp_path / "db", watch=0)
        await tier.open()
        await tier.put_many([(key(i), BLOCK) for i in range(6)])
        await tier.get(key(0))  # the most recently used: kept
        await tier.aclose()
        tier = LMDBTier(tmp_path / "db", watch=0)
        await tier.open()
        try:
            return tier.resident_keys() or []
        finally:
            await tier.aclose()

    assert len(asyncio.run(fill())) == 6
    assert main(["gc", f"lmdb://{tmp_path}/db", "--capacity", str(2 * FRAME)]) == 0
    assert "deleted 4 blocks" in capsys.readouterr().out

    async def left() -> set[bytes]:
        tier = LMDBTier(tmp_path / "db", watch=0)
        await tier.open()
        try:
            return set(tier.resident_keys() or [])
        finally:
            await tier.aclose()

    held = asyncio.run(left())
    assert len(held) == 2 and key(0) in held


def test_gc_of_an_lmdb_path_without_an_environment_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    assert main(["gc", f"lmdb://{tmp_path}/nope", "--capacity", "1GiB"]) == 2
    assert "no LMDB environment" in capsys.readouterr().out
    assert not (tmp_path / "nope").exists()


def test_gc_gives_up_on_an_owner_that_does_not_answer(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main
    from kvtier.tiers.lmdb import LMDBTier
    from kvtier.tiers.lmdb_gc import REQUEST_NAME

    async def run() -> int:
        owner = LMDBTier(tmp_path / "db", watch=0)  # no watch: nobody reads requests
        await owner.open()
        try:
            await owner.put(key(1), BLOCK)
            return await asyncio.to_thread(main, ["gc", f"lmdb://{tmp_path}/db",
                                                  "--capacity", "0", "--wait", "0.3"])
        finally:
            await owner.aclose()

    assert asyncio.run(run()) == 1
    assert "did not answer" in capsys.readouterr().out
    assert not (tmp_path / "db" / REQUEST_NAME).exists()  # withdrawn
