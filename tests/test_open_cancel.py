"""Cancelled and timed-out opens: a file:// probe leaves no ``.kvtier-probe-*`` file behind,
and a cancelled ``open_store`` never returns a store (redis:// included)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import ConfigError, TieredStore, open_store


def _probes(root: Path) -> list[Path]:
    return sorted(root.rglob(".kvtier-probe-*"))


async def _open_and_cancel(url: str, rng: random.Random) -> TieredStore | None:
    """Open ``url`` and cancel the open after a random number of loop turns; the store if
    the open returned one anyway."""
    task = asyncio.ensure_future(open_store([url]))
    for _ in range(rng.randrange(0, 12)):
        await asyncio.sleep(0)
    if rng.random() < 0.5:
        await asyncio.sleep(rng.random() * 0.002)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


@pytest.mark.slow
async def test_cancelled_file_opens_leave_no_probe_file(tmp_path: Path) -> None:
    rng = random.Random(30)
    returned = 0
    for _ in range(200):
        store = await _open_and_cancel(f"file://{tmp_path}", rng)
        if store is not None:  # the cancel came after open_store had returned
            returned += 1
            await store.aclose()
    await asyncio.sleep(0.1)
    # Before: 20-32 of 200 cancelled opens left their probe object behind, forever.
    assert _probes(tmp_path) == []
    assert returned < 200  # the cancellations did land inside the opens


async def test_timed_out_file_opens_leave_no_probe_file(tmp_path: Path) -> None:
    timed_out = 0
    for _ in range(50):
        try:
            store = await open_store([f"file://{tmp_path}?timeout=0.0005"])
        except ConfigError as exc:
            assert "did not finish within" in str(exc) or "probe" in str(exc)
            timed_out += 1
            continue
        await store.aclose()
    await asyncio.sleep(0.1)
    assert _probes(tmp_path) == []  # before: 11 of 50 left one


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # redis-py is an extra (kvtier[redis]): without it only this test skips.
    redis_servers = pytest.importorskip("tests.helpers.redis_servers",
                                        reason="redis-py not installed (kvtier[redis])")
    if redis_servers.MISSING:
        pytest.skip(redis_servers.MISSING)
    server = redis_servers.RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield f"redis://{server.address}"
    server.kill()


async def test_cancelled_redis_opens_never_return_a_store(redis_url: str) -> None:
    rng = random.Random(44)
    returned = 0
    cancelled_inside = 0
    for _ in range(200):
        task = asyncio.ensure_future(open_store([redis_url]))
        for _ in range(rng.randrange(1, 40)):
            await asyncio.sleep(0)
        if task.done():  # opened before the cancel: not a cancelled open
            await (await task).aclose()
            continue
        task.cancel()
        cancelled_inside += 1
        try:
            store = await task
        except asyncio.CancelledError:
            continue
        returned += 1
        await store.aclose()
    # Before: 44 of 200 cancelled opens returned a store (the probe's cancellation came
    # back from the client as a connection error, logged as "server unreachable").
    assert cancelled_inside > 0
    assert returned == 0
