"""Test-suite wide configuration: which tests run on which event loops.

kvtier must work on asyncio's default loop and on uvloop (what vLLM, SGLang and most Python
servers run). The peer tests, the peer conformance suite, the store tests and the tests of
reads served on the loop (LMDB inline, file ``nowait``) therefore run once per loop, in
the same ``pytest`` invocation; every other async test runs on asyncio's default loop
only, to keep the suite's time down. ``--loops=asyncio`` (or ``uvloop``) restricts the
dual-loop modules to one loop. A test of those modules marked ``one_loop`` runs on the first
selected loop only: an expensive test whose behaviour does not depend on the client's loop
(its servers are `kvtier serve` processes, which pick their own); each such module keeps its
loop-sensitive tests on both.

It also loads the hypothesis profile (``ci`` by default, ``thorough`` under
``KVTIER_HYPOTHESIS_PROFILE=thorough``: :mod:`tests.helpers.hypothesis_profiles`) before any
test module builds its settings, and holds the one fixture several peer protocol modules
share, ``served``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
import pytest

from kvtier.peer.server import PeerServer
from tests.helpers.hypothesis_profiles import load_profile
from tests.helpers.peer_helpers import SMALL_LIMITS, served_dram

load_profile()

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test extra
    uvloop = None  # type: ignore[assignment]

# Modules (by file name prefix) whose async tests run on every available loop.
# Plus the two modules whose reads run on the event loop itself (LMDB inline reads, file
# reads with RWF_NOWAIT).
DUAL_LOOP_PREFIXES = ("test_peer_", "test_store", "test_lmdb_inline", "test_fsspec_nowait")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _available_loops() -> dict[str, LoopFactory]:
    loops: dict[str, LoopFactory] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        loops["uvloop"] = uvloop.new_event_loop
    return loops


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--loops", default="all", metavar="NAMES",
                     help="event loops for the peer and store tests: 'all' (default) or a "
                          "comma-separated subset of asyncio,uvloop")


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> Mapping[str, LoopFactory]:
    available = _available_loops()
    if not item.path.name.startswith(DUAL_LOOP_PREFIXES):
        return {"asyncio": available["asyncio"]}
    wanted = config.getoption("--loops")
    if wanted == "all":
        chosen = available
    else:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        unknown = [n for n in names if n not in available]
        if unknown or not names:
            raise pytest.UsageError(f"--loops: unknown or unavailable loop(s) "
                                    f"{unknown or wanted!r} (available: {', '.join(available)})")
        chosen = {n: available[n] for n in names}
    if item.get_closest_marker("one_loop") is not None:
        first = next(iter(chosen))  # asyncio's, unless --loops names others
        return {first: chosen[first]}
    return chosen


@pytest.fixture
async def served() -> AsyncIterator[tuple[PeerServer, aiohttp.ClientSession]]:
    """An in-process DRAM server with :data:`~tests.helpers.peer_helpers.SMALL_LIMITS` and a
    session that takes paths relative to it (a module may define its own ``served``)."""
    async with served_dram(base_url=True, limits=SMALL_LIMITS) as pair:
        yield pair
