"""Persistent tiers against their raw baselines, measured in the same run.

- ``lmdb://`` tier get/put vs raw py-lmdb with the same environment flags (``sync=False,
  metasync=False, writemap=False, readahead=False``): raw put is one write transaction
  per put; raw get is one read transaction that copies the value into a preallocated numpy
  array (one copy, as a user would).
- ``file://`` tier get/put vs raw ``open/write`` and ``open/readinto`` of the same sizes in
  the same directory (no temp file, no rename, no checksum: the floor).
- zstd levels 1 and 3 with and without byte-shuffle on KV-like fp16 blocks
  (:func:`benchmarks.bench_codec.kv_like_block`: 256 tokens x 8 heads x 128 dims for K and
  V; every channel an AR(1) series along tokens times a log-normal per-channel scale, a few
  outlier channels, rounded to fp16; smooth, low-entropy, like real K/V but a little kinder).

Every tier op is awaited on an asyncio loop; the raw baselines call the library on the
calling thread and, in the ``in to_thread`` rows, through ``asyncio.to_thread`` (what a
read costs when it must not block the loop). Tier reads print their ratio against the
``to_thread`` baseline, then against the calling thread. ``lmdb://`` reads resident,
uncompressed blocks on the loop by default (``inline_reads=0``: always a worker thread);
``file://`` reads cached files on the loop where its directory is on a local filesystem
(``nowait=auto``, the default; the default rows name the decision), and the
``nowait=0`` row always reads in a worker thread. Data stays hot in the page cache, so
these are software-overhead figures, not disk figures.

Run ``python -m benchmarks.bench_persist [--quick] [--json FILE] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import lmdb
import numpy as np

from benchmarks.bench_codec import kv_like_block
from benchmarks.common import (
    SIZES,
    Result,
    main_for,
    median_of,
    print_table,
    time_async,
    time_sync,
    with_ratio,
    with_second_ratio,
)
from kvtier.codec import decode_frame, encode_frame
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.lmdb import LMDBTier

__all__ = ["main", "run"]

_WORKING_SET = 32 << 20
_BATCH = 16


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def _payload(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)


Cell = tuple[str, Callable[[], object] | None, Callable[[], Awaitable[object]] | None]


class _Cells:
    """Runs a group of cells round-robin, ``reps`` times, and keeps each cell's median run:
    on this shared, drifting machine a tier and its baseline must be measured side by side."""

    def __init__(self, quick: bool) -> None:
        self.min_time = 0.25 if quick else 0.6
        self.min_ops = 5 if quick else 20
        self.reps = 1 if quick else 3

    async def group(self, bench: str, size: str, nbytes: int, cells: list[Cell]) -> list[Result]:
        runs: list[list[Result]] = [[] for _ in cells]
        for _ in range(self.reps):
            for i, (case, sync_fn, async_fn) in enumerate(cells):
                if sync_fn is not None:
                    lat, wall = time_sync(sync_fn, min_ops=self.min_ops, min_time=self.min_time)
                else:
                    assert async_fn is not None
                    lat, wall = await time_async(async_fn, min_ops=self.min_ops,
                                                 min_time=self.min_time)
                runs[i].append(Result(bench, case, size, lat, nbytes, wall))
        return [median_of(r) for r in runs]


async def _each_size(size_cells: Callable[[_Cells, Path, str, int], Awaitable[list[Result]]],
                     cells: _Cells, root: Path) -> list[Result]:
    """``size_cells`` for every block size of :data:`SIZES`, in order."""
    results: list[Result] = []
    for size_name, nbytes in SIZES.items():
        results += await size_cells(cells, root, size_name, nbytes)
    return results


async def _lmdb_cells(cells: _Cells, root: Path, size_name: str, nbytes: int) -> list[Result]:
    n = max(8, _WORKING_SET // nbytes)
    block = _payload(nbytes)
    out = np.empty(nbytes, dtype=np.uint8)
    raw_dir = root / f"raw-{size_name}"
    raw_dir.mkdir()
    env = lmdb.open(str(raw_dir), map_size=4 * _WORKING_SET + (64 << 20), sync=False,
                    metasync=False, writemap=False, readahead=False, max_dbs=4)
    with env.begin(write=True) as txn:  # every key exists before gets are timed
        for i in range(n):
            txn.put(_key(i), block)
    tier = LMDBTier(root / f"tier-{size_name}", capacity=4 * _WORKING_SET)
    await tier.put_many((_key(i), block) for i in range(n))
    threaded = LMDBTier(root / f"tier-thread-{size_name}", capacity=4 * _WORKING_SET,
                        inline_reads=False)
    await threaded.put_many((_key(i), block) for i in range(n))
    seq = iter(range(1 << 62))

    def raw_put() -> None:
        with env.begin(write=True) as txn:
            txn.put(_key(next(seq) % n), block)

    def raw_get() -> None:
        with env.begin(buffers=True) as txn:
            np.copyto(out, np.frombuffer(txn.get(_key(next(seq) % n)), dtype=np.uint8))

    async def raw_put_thread() -> None:
        await asyncio.to_thread(raw_put)

    async def raw_get_thread() -> None:
        await asyncio.to_thread(raw_get)

    async def tier_put() -> None:
        await tier.put(_key(next(seq) % n), block)

    async def tier_get() -> None:
        assert await tier.get(_key(next(seq) % n)) is not None

    async def tier_get_into() -> None:
        assert await tier.get_into(_key(next(seq) % n), out)

    async def threaded_get() -> None:
        assert await threaded.get(_key(next(seq) % n)) is not None

    async def threaded_get_into() -> None:
        assert await threaded.get_into(_key(next(seq) % n), out)

    def batch() -> list[bytes]:
        base = next(seq) * _BATCH
        return [_key((base + j) % n) for j in range(_BATCH)]

    def raw_put_batch() -> None:
        with env.begin(write=True) as txn:
            for key in batch():
                txn.put(key, block)

    def raw_get_batch() -> None:
        with env.begin(buffers=True) as txn:
            for key in batch():
                np.copyto(out, np.frombuffer(txn.get(key), dtype=np.uint8))

    async def tier_put_batch() -> None:
        await tier.put_many((key, block) for key in batch())

    async def tier_get_batch() -> None:
        assert all(b is not None for b in await tier.get_many(batch()))

    # "in to_thread" rows: what the thread hop alone costs (the tier must not block the loop).
    put_raw, put_raw_t, put_tier = await cells.group("lmdb", size_name, nbytes, [
        ("raw py-lmdb put", raw_put, None),
        ("raw py-lmdb put in to_thread", None, raw_put_thread),
        ("lmdb:// tier put", None, tier_put)])
    # Tier reads: ratio against the same read through to_thread (the target), and against
    # the calling thread (the stretch). The default tier reads resident blocks on the loop;
    # inline_reads=0 shows the worker-thread path.
    get_raw, get_raw_t, get_tier, into_tier, get_thr, into_thr = await cells.group(
        "lmdb", size_name, nbytes, [
            ("raw py-lmdb get+copy", raw_get, None),
            ("raw py-lmdb get+copy in to_thread", None, raw_get_thread),
            ("lmdb:// tier get", None, tier_get),
            ("lmdb:// tier get_into", None, tier_get_into),
            ("lmdb:// get, inline_reads=0", None, threaded_get),
            ("lmdb:// get_into, inline_reads=0", None, threaded_get_into)])
    # Prefix chains move as batches (put_many/get_many): one transaction, one thread hop.
    put_raw_b, put_tier_b, get_raw_b, get_tier_b = await cells.group(
        "lmdb", size_name, _BATCH * nbytes, [
            (f"raw py-lmdb {_BATCH} puts/txn", raw_put_batch, None),
            (f"lmdb:// tier put_many x{_BATCH}", None, tier_put_batch),
            (f"raw py-lmdb {_BATCH} gets/txn+copy", raw_get_batch, None),
            (f"lmdb:// tier get_many x{_BATCH}", None, tier_get_batch)])
    env.close()
    await tier.aclose()
    await threaded.aclose()
    reads = [with_second_ratio(with_ratio(r, get_raw_t), get_raw)
             for r in (get_tier, into_tier, get_thr, into_thr)]
    return [put_raw, with_ratio(put_raw_t, put_raw), with_ratio(put_tier, put_raw),
            get_raw, with_ratio(get_raw_t, get_raw), *reads,
            put_raw_b, with_ratio(put_tier_b, put_raw_b),
            get_raw_b, with_ratio(get_tier_b, get_raw_b)]


def _putter(tier: LMDBTier, n: int, block: np.ndarray) -> Callable[[], Awaitable[None]]:
    seq = iter(range(1 << 62))

    async def put() -> None:
        await tier.put(_key(next(seq) % n), block)
    return put


async def _bench_durability(cells: _Cells, root: Path) -> list[Result]:
    """Cost of ``sync=`` (and ``writemap=1``): tier puts of 64 KiB and 1 MiB per setting."""
    results: list[Result] = []
    for size_name in ("64KiB", "1MiB"):
        nbytes = SIZES[size_name]
        block = _payload(nbytes)
        n = max(8, _WORKING_SET // nbytes)
        tiers = {f"sync={sync}{' writemap=1' if wm else ''}": LMDBTier(
            root / f"dur-{size_name}-{sync}-{wm}", capacity=4 * _WORKING_SET, sync=sync,
            writemap=wm) for sync, wm in (("0", False), ("0", True), ("meta", False),
                                          ("1", False))}
        measured = await cells.group("lmdb-sync", size_name, nbytes, [
            (f"lmdb:// tier put {label}", None, _putter(t, n, block))
            for label, t in tiers.items()])
        for r in measured[1:]:
            with_ratio(r, measured[0])
        results += measured
        for tier in tiers.values():
            await tier.aclose()
    return results


async def _file_cells(cells: _Cells, root: Path, size_name: str, nbytes: int) -> list[Result]:
    n = max(8, _WORKING_SET // nbytes)
    block = _payload(nbytes)
    out = np.empty(nbytes, dtype=np.uint8)
    raw_dir = root / f"rawfiles-{size_name}"
    raw_dir.mkdir()
    tier = FsspecTier(f"file://{root}/tierfiles-{size_name}")
    threaded = FsspecTier(f"file://{root}/tierfiles-{size_name}", nowait=False)  # same files
    default = f"nowait=auto: {'on' if tier.nowait else 'off'}, {tier.fstype}"
    seq = iter(range(1 << 62))

    def raw_write() -> None:
        with open(raw_dir / f"{next(seq) % n}.bin", "wb") as fh:
            fh.write(block.data)

    def raw_read() -> None:
        with open(raw_dir / f"{next(seq) % n}.bin", "rb", buffering=0) as fh:
            fh.readinto(out.data)

    async def raw_write_thread() -> None:
        await asyncio.to_thread(raw_write)

    async def raw_read_thread() -> None:
        await asyncio.to_thread(raw_read)

    async def tier_put() -> None:
        await tier.put(_key(next(seq) % n), block)

    async def tier_get() -> None:
        assert await tier.get(_key(next(seq) % n)) is not None

    async def threaded_get() -> None:
        assert await threaded.get(_key(next(seq) % n)) is not None

    async def tier_get_into() -> None:
        assert await tier.get_into(_key(next(seq) % n), out)

    for i in range(n):  # every file exists before reads are timed
        raw_write()
        await tier.put(_key(i), block)
    put_raw, put_raw_t, put_tier = await cells.group("file", size_name, nbytes, [
        ("raw open/write", raw_write, None),
        ("raw open/write in to_thread", None, raw_write_thread),
        ("file:// tier put (tmp+rename)", None, tier_put)])
    get_raw, get_raw_t, get_tier, into_tier, get_threaded = await cells.group(
        "file", size_name, nbytes, [
            ("raw open/readinto", raw_read, None),
            ("raw open/readinto in to_thread", None, raw_read_thread),
            (f"file:// tier get ({default})", None, tier_get),
            (f"file:// tier get_into ({default})", None, tier_get_into),
            ("file:// tier get, nowait=0", None, threaded_get)])
    await tier.aclose()
    await threaded.aclose()
    reads = [with_second_ratio(with_ratio(r, get_raw_t), get_raw)
             for r in (get_tier, into_tier, get_threaded)]
    return [put_raw, with_ratio(put_raw_t, put_raw), with_ratio(put_tier, put_raw),
            get_raw, with_ratio(get_raw_t, get_raw), *reads]


async def _bench_zstd(cells: _Cells) -> list[Result]:
    block = kv_like_block(0)
    nbytes = block.nbytes
    size_name = f"{nbytes >> 20}MiB"
    raw_frame = encode_frame(block).to_bytes()
    specs: list[Cell] = [("encode raw (checksum only)", lambda: encode_frame(block), None),
                         ("decode raw (checksum only)", lambda: decode_frame(raw_frame), None)]
    ratios: dict[str, float] = {}
    for level in (1, 3):
        for shuffle in (False, True):
            case = f"zstd:{level}{' +shuffle' if shuffle else ''}"
            frame = encode_frame(block, compress_level=level, shuffle=shuffle)
            data = frame.to_bytes()
            ratios[case] = nbytes / frame.nbytes
            specs.append((f"encode {case}", lambda lv=level, sh=shuffle: encode_frame(
                block, compress_level=lv, shuffle=sh), None))
            specs.append((f"decode {case}", lambda d=data: decode_frame(d), None))
    measured = await cells.group("zstd", size_name, nbytes, specs)
    enc_raw, dec_raw = measured[0], measured[1]
    for r in measured[2:]:
        r.extra["compression_ratio"] = round(ratios[r.case.split(" ", 1)[1]], 3)
        with_ratio(r, enc_raw if r.case.startswith("encode") else dec_raw)
    return measured


def run(quick: bool = False, directory: str | None = None) -> list[Result]:
    """Run every cell; returns LMDB, file and zstd results (ratios against raw baselines)."""
    cells = _Cells(quick)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-persist-", dir=directory))
    try:
        async def everything() -> list[Result]:
            return (await _each_size(_lmdb_cells, cells, root)
                    + await _bench_durability(cells, root)
                    + await _each_size(_file_cells, cells, root) + await _bench_zstd(cells))

        return asyncio.run(everything())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = run(args.quick, args.dir)
    print(f"# bench_persist {started}, pid {os.getpid()}, quick={args.quick}")
    print_table([r for r in results if r.bench == "lmdb"], "LMDB tier vs raw py-lmdb")
    print_table([r for r in results if r.bench == "lmdb-sync"],
                "LMDB durability: sync=0 / writemap / meta / 1 (ratio vs sync=0)")
    print_table([r for r in results if r.bench == "file"], "file:// tier vs raw file I/O")
    zstd = [r for r in results if r.bench == "zstd"]
    print_table(zstd, "zstd on KV-like fp16 (ratio: speed vs checksum-only encode/decode)")
    print("\ncompression ratio (raw bytes / frame bytes):")
    for r in zstd:
        if "compression_ratio" in r.extra and r.case.startswith("encode"):
            print(f"  {r.case[7:]:<16} {r.extra['compression_ratio']:.3f}")
    return results, 0


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``, ``--dir DIR``)."""
    return main_for(_report, __doc__, argv, quick="short cells, one repetition",
                    options=_options)


if __name__ == "__main__":
    raise SystemExit(main())
