"""The ``--dry`` engine: feed every configured :class:`Simulation` from one pass over a trace."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.progress import Progress
from kvtier.replay.sim import Simulation
from kvtier.replay.trace import Request

__all__ = ["block_key", "run_dry"]


def block_key(block_id: int) -> bytes:
    """The key a trace block id stands for in the dry engine (8 bytes, little endian)."""
    return block_id.to_bytes(8, "little", signed=True)


def run_dry(requests: Iterable[Request], sims: Sequence[Simulation], *, block_bytes: int,
            progress: Progress | None = None) -> dict[str, Any]:
    """Replay ``requests`` through every simulation; returns counts and the result rows.

    Block keys are interned (one ``bytes`` object per block id), so dict lookups in the
    policies hit cached hashes; all simulations see the same request stream.
    """
    keys_of: dict[int, bytes] = {}
    n_requests = 0
    block_refs = 0
    start = time.perf_counter()
    for req in requests:
        keys: list[bytes] = []
        append = keys.append
        for block_id in req.hash_ids:
            key = keys_of.get(block_id)
            if key is None:
                key = keys_of[block_id] = block_key(block_id)
            append(key)
        for sim in sims:
            sim.feed(req, keys)
        n_requests += 1
        block_refs += len(keys)
        if progress is not None and progress.total == 0:
            progress.update(1)
    elapsed = time.perf_counter() - start
    rows = [sim.result(block_bytes) for sim in sims]
    for row in rows:
        row["engine"] = "dry"
    return {"requests": n_requests, "block_refs": block_refs, "unique_blocks": len(keys_of),
            "elapsed_s": elapsed, "results": rows}
