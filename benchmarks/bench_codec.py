"""Block codec costs: checksum algorithms, frame encode/decode, zstd and byte-shuffle.

Every figure is compared with a baseline measured in the same run: numpy memcpy of the same
size (the cost of the cheapest possible get of a block that leaves process memory) and, for
the checksum budget, a 1 MiB request/response over loopback TCP.

Run ``python -m benchmarks.bench_codec [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import threading
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from benchmarks.common import SIZES, Result, main_for, print_table, time_sync, with_ratio
from kvtier.codec import decode_frame, encode_frame

__all__ = ["kv_like_block", "main", "run"]

BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 256, 8, 128


def kv_like_block(seed: int = 0, dtype: Any = np.float16) -> npt.NDArray[Any]:
    """One KV block shaped like a Llama-3-8B page: K and V for 256 tokens x 8 KV heads x
    128 dims (2 x 512 KiB in fp16, 1 MiB in all).

    Real caches have a few outlier channels with large magnitudes (keys especially),
    per-head scales, and values that drift smoothly from token to token; each channel here
    is an AR(1) process along tokens (rho 0.95 for K, 0.6 for V) times a log-normal
    per-(head, channel) scale with 2% outlier channels x8. The high byte of each fp16
    (sign, exponent) is then nearly constant along a channel while the mantissa byte stays
    noisy, which is what byte-shuffle exploits. Real KV usually compresses *less* than this.
    """
    rng = np.random.default_rng(seed)
    shape = (BLOCK_TOKENS, KV_HEADS, HEAD_DIM)

    def channels(rho: float) -> npt.NDArray[np.float64]:
        noise = rng.standard_normal(shape)
        out = np.empty(shape)
        out[0] = noise[0]
        for t in range(1, BLOCK_TOKENS):
            out[t] = rho * out[t - 1] + np.sqrt(1 - rho * rho) * noise[t]
        scale = rng.lognormal(0.0, 0.5, size=shape[1:])
        scale[rng.random(shape[1:]) < 0.02] *= 8
        return (out + rng.normal(0, 0.5, size=shape[1:])) * scale

    kv = np.stack([channels(0.95), channels(0.6)])  # (2, tokens, heads, dim)
    return np.ascontiguousarray(kv.astype(dtype))


def _payload(nbytes: int, seed: int = 1) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _cell(bench: str, case: str, size: str, nbytes: int, fn: Callable[[], object],
          min_time: float, **extra: Any) -> Result:
    fn()  # warm up (allocations, thread-local zstd contexts)
    lat, wall = time_sync(fn, min_ops=5, min_time=min_time)
    return Result(bench, case, size, lat, nbytes, wall, extra=dict(extra))


def _memcpy(bench: str, size: str, nbytes: int, min_time: float) -> Result:
    src, dst = _payload(nbytes), np.empty(nbytes, dtype=np.uint8)
    return _cell(bench, "numpy memcpy (baseline)", size, nbytes,
                 lambda: np.copyto(dst, src), min_time)


class _LoopbackServer:
    """Answers each 1-byte request with ``nbytes`` bytes over loopback TCP (a remote get
    stripped to the transfer itself)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(self._listener.getsockname())
        self._conn, _ = self._listener.accept()
        self._data = _payload(nbytes).tobytes()
        self._buf = bytearray(nbytes)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._conn.recv(1):
            self._conn.sendall(self._data)

    def get(self) -> None:
        self.client.sendall(b"g")
        view, got = memoryview(self._buf), 0
        while got < self.nbytes:
            got += self.client.recv_into(view[got:])

    def close(self) -> None:
        self.client.close()
        self._thread.join(timeout=5)
        self._conn.close()
        self._listener.close()


def bench_checksums(min_time: float) -> list[Result]:
    algorithms: dict[str, Callable[[bytes], object]] = {
        "zlib.crc32": zlib.crc32,
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
    }
    results: list[Result] = []
    for size, nbytes in SIZES.items():
        base = _memcpy("checksum", size, nbytes, min_time)
        results.append(base)
        data = _payload(nbytes).tobytes()
        for name, algo in algorithms.items():
            cell = _cell("checksum", name, size, nbytes, partial(algo, data), min_time)
            cell.extra["pct_of_memcpy"] = 100 * cell.pct(0.5) / base.pct(0.5)
            results.append(with_ratio(cell, base))
    return results


def _encode_to_bytes(block: npt.NDArray[Any]) -> bytes:
    return encode_frame(block).to_bytes()


def _decode_copy(frame: bytes) -> npt.NDArray[Any]:
    return decode_frame(frame).copy()


def bench_frames(min_time: float) -> list[Result]:
    results: list[Result] = []
    for size, nbytes in SIZES.items():
        base = _memcpy("frame", size, nbytes, min_time)
        results.append(base)
        block = _payload(nbytes).view(np.float16)
        frame = encode_frame(block).to_bytes()
        cells: list[tuple[str, Callable[[], object]]] = [
            ("encode raw (header+view)", partial(encode_frame, block)),
            ("encode raw + to_bytes", partial(_encode_to_bytes, block)),
            ("decode raw (verify, view)", partial(decode_frame, frame)),
            ("decode raw + copy out", partial(_decode_copy, frame)),
        ]
        for case, fn in cells:
            cell = _cell("frame", case, size, nbytes, fn, min_time)
            cell.extra["pct_of_memcpy"] = 100 * cell.pct(0.5) / base.pct(0.5)
            results.append(with_ratio(cell, base))
    return results


def bench_loopback(min_time: float) -> list[Result]:
    nbytes = SIZES["1MiB"]
    server = _LoopbackServer(nbytes)
    try:
        transfer = _cell("loopback", "TCP loopback 1 MiB get", "1MiB", nbytes, server.get,
                         min_time)
    finally:
        server.close()
    return [transfer]


def bench_zstd(min_time: float) -> list[Result]:
    blocks: dict[str, npt.NDArray[Any]] = {
        "kv fp16": kv_like_block(),
        "noise fp16": np.random.default_rng(2).standard_normal(
            (2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)).astype(np.float16),
    }
    try:
        import ml_dtypes

        blocks["kv bf16"] = kv_like_block(dtype=ml_dtypes.bfloat16)
    except ImportError:
        pass
    results: list[Result] = []
    for label, block in blocks.items():
        nbytes = block.nbytes
        base = _memcpy("zstd-base", "1MiB", nbytes, min_time)
        for level in (1, 3):
            for shuffle in (False, True):
                frame = encode_frame(block, compress_level=level, shuffle=shuffle)
                wire = frame.to_bytes()
                ratio = nbytes / frame.payload.nbytes
                tag = f"{label} zstd{level}{'+shuf' if shuffle else ''}"
                enc = _cell("zstd", f"{tag} enc", "1MiB", nbytes,
                            partial(encode_frame, block, compress_level=level,
                                    shuffle=shuffle), min_time,
                            compression_ratio=ratio, flags=frame.header[5])
                dec = _cell("zstd", f"{tag} dec", "1MiB", nbytes,
                            partial(decode_frame, wire), min_time,
                            compression_ratio=ratio, flags=frame.header[5])
                results += [with_ratio(enc, base), with_ratio(dec, base)]
    return results


def print_budget(results: list[Result]) -> None:
    """The checksum's share of a 1 MiB get, against the < 10% target."""
    by_case = {(r.bench, r.case, r.size): r for r in results}
    memcpy = by_case[("checksum", "numpy memcpy (baseline)", "1MiB")].pct(0.5)
    loop = by_case.get(("loopback", "TCP loopback 1 MiB get", "1MiB"))
    print("\n## checksum share of a 1 MiB get (p50; target < 10%)")
    print(f"{'checksum':<14} {'p50 us':>8} {'% of memcpy get':>16} {'% of loopback get':>18}")
    for name in ("zlib.crc32", "xxh3_64", "xxh3_128", "blake2b-128"):
        t = by_case[("checksum", name, "1MiB")].pct(0.5)
        loop_pct = f"{100 * t / loop.pct(0.5):>17.1f}%" if loop else f"{'n/a':>18}"
        print(f"{name:<14} {t * 1e6:>8.1f} {100 * t / memcpy:>15.1f}% {loop_pct}")
    if loop:
        print(f"(memcpy 1 MiB p50 {memcpy * 1e6:.1f} us; loopback 1 MiB get p50 "
              f"{loop.pct(0.5) * 1e6:.1f} us)")


def print_zstd(results: list[Result]) -> None:
    print("\n## zstd on 1 MiB blocks: ratio and speed (MB/s of raw data)")
    print(f"{'data / codec':<26} {'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9} {'kept':>5}")
    rows = [r for r in results if r.bench == "zstd"]
    for enc, dec in zip(rows[::2], rows[1::2], strict=True):
        tag = enc.case.removesuffix(" enc")
        kept = "zstd" if enc.extra["flags"] else "raw"
        print(f"{tag:<26} {enc.extra['compression_ratio']:>6.3f} {enc.gbps * 1e3:>9.0f} "
              f"{dec.gbps * 1e3:>9.0f} {kept:>5}")


def run(quick: bool = False) -> list[Result]:
    """Run every section; ``quick`` shortens each cell (for tox -e bench and CI)."""
    min_time = 0.05 if quick else 0.3
    results = bench_checksums(min_time)
    results += bench_frames(min_time)
    results += bench_loopback(min_time)
    results += bench_zstd(min_time)
    return results


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    results = run(args.quick)
    print_table([r for r in results if r.bench == "checksum"],
                "checksums vs numpy memcpy (same size, same run)")
    print_table([r for r in results if r.bench in ("frame", "loopback")],
                "frame encode/decode (raw) vs numpy memcpy")
    print_budget(results)
    print_zstd(results)
    return results, 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``)."""
    return main_for(_report, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
