"""A 32-block prefix fetched end to end: ``lookup_prefix`` + ``get_many_into`` through
``dram -> peers -> lmdb``, with the prefix held by one tier at a time.

The peer is a ``kvtier serve`` child process on 127.0.0.1 (``dram://``); the client store is
``[dram, peers, lmdb]`` in this process, with promotion off (``promote`` after 2**30 hits)
so every round reads the tier under test. Baselines, same run:

- ``lookup_prefix+32 get_into``: the same lookup, then 32 single ``store.get_into`` calls
  (the batch path must be at least as fast per byte). A block held by ``lmdb`` is first
  missed by ``dram`` and the peer (one request per block on the single path, one per batch
  on the batch path), as in any chain.
- ``numpy copy x32``: copying 32 warm blocks into the outputs (the memory floor);
- ``raw py-lmdb 32 gets/txn+copy``: the LMDB floor on the calling thread.

Run ``python -m benchmarks.bench_prefix [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

import lmdb
import numpy as np

from benchmarks.bench_peer import HOST, TOKEN, _child
from benchmarks.common import (
    Result,
    main_for,
    median_of,
    print_table,
    time_async,
    time_sync,
    with_ratio,
    with_second_ratio,
)
from kvtier.store import TieredStore
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.lmdb import LMDBTier

__all__ = ["run"]

PREFIX = 32
SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20}


def _keys(tag: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(15, "big") for i in range(PREFIX)]


async def _cells(member: str, root: Path, size: str, nbytes: int, min_ops: int,
                 min_time: float) -> list[Result]:
    from kvtier.peer.tier import PeerTier

    blocks = [np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)
              for i in range(PREFIX)]
    outs = [np.empty(nbytes, np.uint8) for _ in range(PREFIX)]
    moved = PREFIX * nbytes
    store = TieredStore([DRAMTier(capacity=2 * moved),
                         PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=30"),
                         LMDBTier(root / f"lmdb-{size}", capacity=4 * moved)],
                        promote=1 << 30)
    raw_env = lmdb.open(str(root / f"raw-{size}"), map_size=8 * moved, sync=False,
                        metasync=False, readahead=False)
    with raw_env.begin(write=True) as txn:
        for key, block in zip(_keys(9), blocks, strict=True):
            txn.put(key, block)
    out: list[Result] = []
    async with store:
        placed = {"dram": _keys(1), "peers": _keys(2), "lmdb": _keys(3)}
        for index, keys in enumerate(placed.values()):
            await store.tiers[index].put_many(zip(keys, blocks, strict=True))

        def copy_all() -> None:
            for src, dst in zip(blocks, outs, strict=True):
                np.copyto(dst, src)

        def raw_lmdb() -> None:
            with raw_env.begin(buffers=True) as txn:
                for key, dst in zip(_keys(9), outs, strict=True):
                    np.copyto(dst, np.frombuffer(txn.get(key), np.uint8))

        lat, wall = time_sync(copy_all, min_ops=min_ops, min_time=min_time)
        floor = Result("prefix", f"numpy copy x{PREFIX}", size, lat, moved, wall)
        lat, wall = time_sync(raw_lmdb, min_ops=min_ops, min_time=min_time)
        raw = Result("prefix", f"raw py-lmdb {PREFIX} gets/txn+copy", size, lat, moved, wall)
        out += [floor, with_ratio(raw, floor)]
        for tier, keys in placed.items():
            async def batch(keys: list[bytes] = keys) -> None:
                hit = await store.lookup_prefix(keys)
                if hit != PREFIX or not all(await store.get_many_into(keys, outs)):
                    raise RuntimeError("prefix not found whole")

            async def single(keys: list[bytes] = keys) -> None:
                if await store.lookup_prefix(keys) != PREFIX:
                    raise RuntimeError("prefix not found whole")
                for key, dst in zip(keys, outs, strict=True):
                    if not await store.get_into(key, dst):
                        raise RuntimeError("block missing")

            lat, wall = await time_async(single, min_ops=min_ops, min_time=min_time)
            one = Result("prefix", f"{tier}: lookup_prefix+{PREFIX} get_into", size, lat, moved,
                         wall)
            lat, wall = await time_async(batch, min_ops=min_ops, min_time=min_time)
            many = Result("prefix", f"{tier}: lookup_prefix+get_many_into", size, lat, moved,
                          wall)
            out += [with_ratio(one, floor),
                    with_second_ratio(with_ratio(many, one),
                                      raw if tier == "lmdb" else floor)]
    raw_env.close()
    return out


def run(quick: bool = False) -> list[Result]:
    """Every cell, 3 interleaved repeats (1 when ``quick``), medians kept."""
    min_ops, min_time, repeats = (3, 0.2, 1) if quick else (5, 0.5, 3)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN)
        serve = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"{HOST}:0",
                 "--tier", "dram://", "--token-file", str(token_file)]
        _, line = stack.enter_context(_child(serve, "listening on"))
        member = line.split("listening on ")[1].split()[0]
        for size, nbytes in SIZES.items():
            runs = []
            for rep in range(repeats):
                root = Path(tmp) / f"{size}-{rep}"
                root.mkdir()
                runs.append(asyncio.run(_cells(member, root, size, nbytes, min_ops, min_time)))
            for column in zip(*runs, strict=True):
                results.append(median_of(column))
    return results


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    results = run(args.quick)
    print_table(results, f"prefix of {PREFIX} blocks: lookup_prefix + get_many_into per tier")
    return results, 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``)."""
    return main_for(_report, __doc__.splitlines()[0], argv, quick="short runs (CI smoke)")


if __name__ == "__main__":
    raise SystemExit(main())
