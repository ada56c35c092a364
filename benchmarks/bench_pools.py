"""Pool tiers side by side, same run: ``peers://`` (kvtier's own pool) vs ``redis://`` vs
``mooncake://``.

Every server is a child process on 127.0.0.1 and the client is this process, each through
its kvtier tier (checksummed frames both ways):

- ``peers``: :class:`kvtier.peer.PeerTier` against ``kvtier serve --tier dram://`` (token).
- ``redis``: :class:`kvtier.tiers.redis_tier.RedisTier` against ``redis-server`` (no
  persistence, ``allkeys-lru``).
- ``mooncake``: :class:`kvtier.tiers.mooncake_tier.MooncakeTier` against ``mooncake_master``
  with the pool's memory segment mounted by another process (TCP transport), so every block
  crosses a process boundary as with the others.

Cells: ``get`` and ``put`` of one block at concurrency 1 and 8, ``batch16 get`` /
``batch16 put`` (16 blocks per call). For each size and concurrency the systems run back to
back, round robin for 3 repetitions (the median is kept); ratios are against ``peers`` in the
same cell. A system whose server is not installed is skipped with a message.

Usage: ``python -m benchmarks.bench_pools [--quick] [--json FILE] [--sizes 1MiB,..]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np

from benchmarks.bench_peer import HOST, REPO, TOKEN, stop_child
from benchmarks.common import (
    SIZES,
    Result,
    main_for,
    median_of,
    print_table,
    time_op_pool,
    with_ratio,
)
from kvtier.tiers.base import Tier

Op = Callable[[], Awaitable[object]]
_CASES = ("get", "put", "batch16 get", "batch16 put")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} is not listening on {port}")
        time.sleep(0.05)


@contextlib.contextmanager
def _child(args: list[str], *, ready: str | None = None, port: int | None = None,
           env: dict[str, str] | None = None) -> Iterator[str]:
    """A child process, stopped by PID on exit; yields its ready line (or '')."""
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    try:
        line = ""
        if ready is not None:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            while ready not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
            if ready not in line:
                raise RuntimeError(f"child {args[:4]} did not start")
        if port is not None:
            _wait_port(port, proc)
        yield line.strip()
    finally:
        stop_child(proc)


def _mooncake_env() -> dict[str, str]:
    return {"MC_TCP_BIND_ADDRESS": HOST, "GLOG_minloglevel": "2"}


def hold_mooncake(url: str) -> None:
    """Child process: mount the pool's segment through a tier, then wait for SIGTERM."""
    from kvtier.tiers.registry import tier_from_url

    async def hold() -> None:
        async with tier_from_url(url) as tier:
            await tier.contains(b"warm-up-key-0000")
            print("READY", flush=True)
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await stop.wait()

    asyncio.run(hold())


def _servers(stack: contextlib.ExitStack, tmp: Path) -> dict[str, str]:
    """Start what is installed; return system -> tier URL for this process."""
    py = sys.executable
    urls: dict[str, str] = {}
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    line = stack.enter_context(_child(
        [py, "-m", "kvtier.cli", "serve", "--listen", f"{HOST}:0", "--tier", "dram://",
         "--token-file", str(token_file)], ready="listening on"))
    member = line.split("listening on ")[1].split()[0]
    urls["peers"] = f"peers://{member}?token={TOKEN}&timeout=30"

    redis_server = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        redis_server = None
    if redis_server is None:
        print("redis-server or redis-py not installed: skipping redis:// "
              "(apt-get install -y redis-server; pip install 'kvtier[redis]')")
    else:
        port = _free_port()
        stack.enter_context(_child(
            [redis_server, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly",
             "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru",
             "--loglevel", "warning"], port=port))
        urls["redis"] = f"redis://{HOST}:{port}?timeout=30&max_connections=64"

    master = Path(py).parent / "mooncake_master"
    os.environ.update(_mooncake_env())  # read when the client library loads
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        print(f"Mooncake client unavailable ({exc}): skipping mooncake:// "
              "(pip install 'kvtier[mooncake]'; apt-get install -y libibverbs1 librdmacm1 "
              "libnuma1)")
        return urls
    if not master.exists():
        print("mooncake_master not found: skipping mooncake://")
        return urls
    port = _free_port()
    stack.enter_context(_child(
        [str(master), f"--rpc_port={port}", f"--rpc_address={HOST}",
         f"--metrics_host={HOST}", f"--metrics_port={_free_port()}"],
        port=port, env=_mooncake_env()))
    base = f"mooncake://{HOST}:{port}?protocol=tcp&local_host={HOST}"
    stack.enter_context(_child(
        [py, "-c", "import sys; from benchmarks.bench_pools import hold_mooncake as h; "
         "h(sys.argv[1])", f"{base}&segment=1GiB&local_buffer=64MiB&staging=16MiB"],
        ready="READY", env=_mooncake_env()))
    urls["mooncake"] = f"{base}&segment=0&local_buffer=512MiB&staging=384MiB&timeout=30"
    return urls


async def _cell(results: list[Result], system: str, case: str, size: str, nbytes: int,
                conc: int, op: Callable[[int], Op], min_time: float) -> None:
    lat, wall = await time_op_pool(op, conc, min_time)
    results.append(Result("pools", f"{system} {case}", size, lat, nbytes, wall,
                          concurrency=conc))


def _ops(tier: Tier, keys: list[list[bytes]], blocks: list[np.ndarray],
         case: str) -> Callable[[int], Op]:
    """Worker ``w`` uses its own 16 keys, so concurrent puts never write one key twice."""
    if case == "get":
        return lambda w: lambda: tier.get(keys[w][0])
    if case == "put":
        return lambda w: lambda: tier.put(keys[w][0], blocks[w % 16])
    if case == "batch16 get":
        return lambda w: lambda: tier.get_many(keys[w])
    return lambda w: lambda: tier.put_many(list(zip(keys[w], blocks, strict=True)))


async def _run_all(quick: bool, sizes: dict[str, int]) -> list[Result]:
    from kvtier.tiers.registry import tier_from_url

    concs = [1, 8]
    min_time = 0.25 if quick else 0.6
    reps = 1 if quick else 3
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        urls = _servers(stack, Path(tmp))
        tiers = {name: tier_from_url(url) for name, url in urls.items()}
        try:
            for label, nbytes in sizes.items():
                blocks = [np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)
                          for i in range(16)]
                keys = [[f"{label}-{w}-{i}".encode().ljust(16, b".") for i in range(16)]
                        for w in range(max(concs))]
                for tier in tiers.values():
                    for worker_keys in keys:
                        await tier.put_many(list(zip(worker_keys, blocks, strict=True)))
                for conc in concs:
                    runs: dict[tuple[str, str], list[Result]] = {}
                    for _ in range(reps):  # round robin: drift hits every system alike
                        for case in _CASES:
                            moved = 16 * nbytes if case.startswith("batch16") else nbytes
                            for name, tier in tiers.items():
                                await _cell(runs.setdefault((name, case), []), name, case,
                                            label, moved, conc, _ops(tier, keys, blocks, case),
                                            min_time)
                    results += [median_of(r) for r in runs.values()]
        finally:
            for tier in tiers.values():
                await tier.aclose()
    return results


def _attach_ratios(results: list[Result]) -> None:
    by = {(r.case, r.size, r.concurrency): r for r in results}
    for r in results:
        system, _, case = r.case.partition(" ")
        base = by.get((f"peers {case}", r.size, r.concurrency))
        if system != "peers" and base is not None:
            with_ratio(r, base)


def run(quick: bool = False, sizes: dict[str, int] | None = None) -> list[Result]:
    """Run every cell (default: 1 MiB blocks) and return the results, ratios attached."""
    results = asyncio.run(_run_all(quick, sizes or {"1MiB": SIZES["1MiB"]}))
    _attach_ratios(results)
    return results


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    sizes = {label: SIZES[label] for label in args.sizes}
    results = run(args.quick, sizes)
    for label in sizes:
        rows = sorted((r for r in results if r.size == label),
                      key=lambda r: (r.concurrency, r.case.partition(" ")[2], r.case))
        print_table(rows, f"pool tiers, {label} blocks (ratio: against peers, same cell)")
    return results, 0


def _sizes(text: str) -> list[str]:
    labels = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SIZES]
    if unknown or not labels:
        raise argparse.ArgumentTypeError(f"--sizes: unknown size(s) {unknown}; "
                                         f"choose from {', '.join(SIZES)}")
    return labels


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_sizes, default=["1MiB"], metavar="LIST",
                        help=f"comma-separated block sizes (of {', '.join(SIZES)})")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``, ``--sizes``)."""
    return main_for(_report, __doc__.split("\n\n")[0], argv,
                    quick="short cells, one repetition", options=_options)


if __name__ == "__main__":
    sys.exit(main())
