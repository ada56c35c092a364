"""Peer tier throughput next to its baselines, all measured in the same run.

Servers run as child processes on 127.0.0.1 (client and server each get a core); the client
is this process. Cells, for 64 KiB / 1 MiB / 4 MiB blocks at concurrency 1 / 8 / 32:

- ``peer get`` / ``peer put``: :class:`kvtier.peer.PeerTier` against ``kvtier serve``
  (checksummed frames, bearer token, DRAM segment); ``peer batch16 get``: one ``get_many``
  of 16 blocks (one request). The ``, aiohttp server`` variants run against a second
  ``kvtier serve --no-data-plane``: the same server with every request through aiohttp.
- ``peer get, baseline server`` / ``peer put, baseline server`` (with ``--baseline DIR``):
  the same client against a ``kvtier serve`` run from another source tree (say ``git
  archive main``), so a server-side change (stamps and tombstones, say) is measured against
  the code before it in the same run; this client sends its stamps there too (ignored).
- ``tcp proto get``: raw asyncio TCP, BufferedProtocol receiving into a preallocated buffer
  (the ceiling for an asyncio peer).
- ``aiohttp get`` / ``aiohttp put``: bare aiohttp server and client moving the same bytes
  (``aiohttp get joined``: the server first joins a 40-byte header to the payload, as a
  frame response would without two writes: measures what the zero-copy response saves).
- ``redis get`` / ``redis set``: redis-server + redis-py asyncio (skipped with a message when
  redis-server is not installed).
- ``mooncake get_into`` / ``mooncake batch_get_into`` (16 blocks per call), concurrency 1 / 8:
  Mooncake Store over its TCP transport, measured by ``../shared/bench/bench_mooncake.py``
  run as a child process right after each size's other cells (see
  :mod:`benchmarks.mooncake_baseline`; skipped with a message when the script or
  ``mooncake.store`` is missing).

Usage: ``python -m benchmarks.bench_peer [--quick] [--json FILE] [--profile] [--sizes 1MiB,..]
[--mooncake auto|off|PATH] [--baseline DIR] [--stamps-log]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np

from benchmarks import mooncake_baseline
from benchmarks.common import (
    SIZES,
    Result,
    main_for,
    median_of,
    print_table,
    time_op_pool,
    with_ratio,
    with_second_ratio,
)

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
TOKEN = "bench-token"
_REQ = struct.Struct(">cQ")
Op = Callable[[], Awaitable[object]]


# ------------------------------------------------------------------ child servers
def _serve_raw() -> None:
    """Raw TCP server: request = op 'G' + u64 size; answers ``size`` payload bytes."""
    payload = memoryview(np.random.default_rng(1).integers(0, 255, max(SIZES.values()),
                                                           dtype=np.uint8))

    class Proto(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.head = bytearray(_REQ.size)
            self.have = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.tr = transport
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP,
                                                          socket.TCP_NODELAY, 1)

        def get_buffer(self, sizehint: int) -> memoryview:
            return memoryview(self.head)[self.have :]

        def buffer_updated(self, nbytes: int) -> None:
            self.have += nbytes
            if self.have == _REQ.size:
                self.have = 0
                _, size = _REQ.unpack(self.head)
                self.tr.write(payload[:size])

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, HOST, 0, backlog=512)
        print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    asyncio.run(main())


def _serve_aiohttp() -> None:
    """Bare aiohttp server: GET /b/{size} returns bytes, PUT /b/{size} reads the body."""
    from aiohttp import web

    payload = np.random.default_rng(1).integers(0, 255, max(SIZES.values()),
                                                dtype=np.uint8).tobytes()
    header = bytes(40)

    async def get(request: web.Request) -> web.StreamResponse:
        size = int(request.match_info["size"])
        return web.Response(body=memoryview(payload)[:size])

    async def get_joined(request: web.Request) -> web.StreamResponse:
        size = int(request.match_info["size"])
        return web.Response(body=b"".join((header, memoryview(payload)[: size - 40])))

    async def put(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=204)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/b/{size}", get)
    app.router.add_get("/j/{size}", get_joined)
    app.router.add_put("/b/{size}", put)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0, backlog=512)
        await site.start()
        print(f"READY {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def stop_child(proc: subprocess.Popen[str]) -> None:
    """SIGTERM a benchmark's child process; kill it if it has not exited within 15 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _child(args: list[str], ready: str, tree: Path = REPO
           ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(args, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if ready in line or not line:
                break
        if ready not in line:
            raise RuntimeError(f"child {args[:4]} did not start")
        yield proc, line.strip()
    finally:
        stop_child(proc)


# ---------------------------------------------------------------------- clients
class RawClient(asyncio.BufferedProtocol):
    """Receives GET payloads straight into a preallocated buffer."""

    def __init__(self, max_size: int) -> None:
        self.buf = memoryview(bytearray(max_size))
        self.need = self.have = 0
        self.fut: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.tr = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.have : self.need] if self.need > self.have else self.buf[:1]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        if self.have >= self.need and self.fut is not None and not self.fut.done():
            self.fut.set_result(self.have)

    async def get(self, size: int) -> int:
        self.have, self.need = 0, size
        self.fut = asyncio.get_running_loop().create_future()
        self.tr.write(_REQ.pack(b"G", size))
        return await self.fut


async def _cell(results: list[Result], case: str, size: str, nbytes: int, conc: int,
                make_op: Callable[[int], Op], min_time: float) -> None:
    lat, wall = await time_op_pool(make_op, conc, min_time)
    results.append(Result("peer", case, size, lat, nbytes, wall, concurrency=conc))


# ----------------------------------------------------------------------- cells
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def _redis(port: int) -> AsyncIterator[object | None]:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        print("redis-server not installed: skipping the Redis columns "
              "(apt-get install -y redis-server)")
        yield None
        return
    import redis.asyncio as aioredis

    args = [redis_server, "--port", str(port), "--bind", HOST, "--save", "",
            "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
    client = aioredis.Redis(host=HOST, port=port, max_connections=64)
    try:
        await _wait_port(port)
        yield client
    finally:
        await client.aclose()
        proc.terminate()
        await proc.wait()


class _Profiler:
    """cProfile switched on only around the peer cells."""

    def __init__(self, enabled: bool) -> None:
        self.prof = cProfile.Profile() if enabled else None

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        if self.prof is not None:
            self.prof.enable()
        try:
            yield
        finally:
            if self.prof is not None:
                self.prof.disable()


async def _run_all(quick: bool, profile: bool, sizes: dict[str, int],
                   server_loop: str = "auto", mooncake: Path | None = None,
                   baseline: Path | None = None, stamps_log: bool = False) -> list[Result]:
    """All servers up at once; for each size and concurrency the systems run back to back,
    round robin for 3 repetitions (the median is kept), so every ratio compares cells
    measured seconds apart (the machine drifts up to 2x between periods). The Mooncake
    script (``mooncake``, if given) runs after each size's cells, with the same cell time and
    repetitions."""
    import aiohttp

    from kvtier.peer.tier import PeerTier

    concs = [1, 8] if quick else [1, 8, 32]
    min_time = 0.25 if quick else 0.6
    reps = 1 if quick else 3
    results: list[Result] = []
    py = sys.executable
    module = [py, "-c", "import sys; from benchmarks import bench_peer as b; "
              "getattr(b, sys.argv[1])()"]
    prof = _Profiler(profile)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN)
        serve = [py, "-m", "kvtier.cli", "serve", "--listen", f"{HOST}:0", "--tier", "dram://",
                 "--token-file", str(token_file), "--loop", server_loop]
        server_prof = Path(tmp) / "server.prof"
        if profile:
            serve[1:1] = ["-m", "cProfile", "-o", str(server_prof)]
            # Runs last in the stack: after the server has exited and written its profile.
            stack.callback(lambda: server_prof.exists() and _print_profile(
                "server (kvtier serve)", pstats.Stats(str(server_prof))))
        def log(name: str) -> list[str]:  # each server its own stamps log (--stamps-log)
            return ["--versions", str(Path(tmp) / f"{name}.versions")] if stamps_log else []

        proc, line = stack.enter_context(_child([*serve, *log("main")], "listening on"))
        member = line.split("listening on ")[1].split()[0]
        server_pid = {"": proc.pid}
        # The same server with the data plane off: every request through aiohttp.
        proc, line = stack.enter_context(_child([*serve, "--no-data-plane", *log("aiohttp")],
                                                "listening on"))
        server_pid[", aiohttp server"] = proc.pid
        aio_member = line.split("listening on ")[1].split()[0]
        base_member = None
        if baseline is not None:  # the same server from another source tree
            proc, line = stack.enter_context(_child([*serve, *log("baseline")], "listening on",
                                                    baseline))
            server_pid[", baseline server"] = proc.pid
            base_member = line.split("listening on ")[1].split()[0]
        proc, line = stack.enter_context(_child([*module, "_serve_raw"], "READY"))
        raw_port, server_pid["tcp"] = int(line.split()[1]), proc.pid
        proc, line = stack.enter_context(_child([*module, "_serve_aiohttp"], "READY"))
        http_port, server_pid["aiohttp"] = int(line.split()[1]), proc.pid
        tier = PeerTier.from_url(f"peers://{member}?token={TOKEN}&timeout=30")
        aio_tier = PeerTier.from_url(f"peers://{aio_member}?token={TOKEN}&timeout=30")
        base_tier = PeerTier.from_url(f"peers://{base_member or member}?token={TOKEN}"
                                      "&timeout=30")
        async with tier, aio_tier, base_tier, _redis(_free_port()) as rds, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64)) as http:
            async def fetch(url: str) -> bytes:
                async with http.get(url) as r:
                    return await r.read()

            async def send(url: str, body: bytes) -> None:
                async with http.put(url, data=body) as r:
                    await r.read()

            loop = asyncio.get_running_loop()
            for label, nbytes in sizes.items():
                blocks = [np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)
                          for i in range(16)]
                keys = [f"{label}-{i}".encode().ljust(16, b".") for i in range(16)]
                body = blocks[0].tobytes()
                await tier.put_many(list(zip(keys, blocks, strict=True)))
                await aio_tier.put_many(list(zip(keys, blocks, strict=True)))
                await base_tier.put_many(list(zip(keys, blocks, strict=True)))
                if rds is not None:
                    await rds.set(f"k{label}", body)  # type: ignore[attr-defined]
                plain = f"http://{HOST}:{http_port}/b/{nbytes}"
                joined = f"http://{HOST}:{http_port}/j/{nbytes}"
                for conc in concs:
                    raws: list[RawClient] = []
                    for _ in range(conc):
                        _, proto = await loop.create_connection(
                            lambda n=nbytes: RawClient(n), HOST, raw_port)
                        raws.append(proto)
                    cells: list[tuple[str, int, Callable[[int], Op]]] = [
                        ("tcp proto get", nbytes, lambda w, c=raws, n=nbytes: lambda: c[w].get(n)),
                        ("aiohttp get", nbytes, lambda w, u=plain: lambda: fetch(u)),
                        ("aiohttp get joined", nbytes, lambda w, u=joined: lambda: fetch(u)),
                        ("peer get", nbytes, lambda w, k=keys: lambda: tier.get(k[w % 16])),
                        ("peer get, aiohttp server", nbytes,
                            lambda w, k=keys: lambda: aio_tier.get(k[w % 16])),
                        ("aiohttp put", nbytes, lambda w, u=plain, b=body: lambda: send(u, b)),
                        ("peer put", nbytes, lambda w, k=keys, b=blocks:
                            lambda: tier.put(k[w % 16], b[w % 16])),
                        ("peer put, aiohttp server", nbytes, lambda w, k=keys, b=blocks:
                            lambda: aio_tier.put(k[w % 16], b[w % 16])),
                    ]
                    if base_member is not None:
                        cells += [
                            ("peer get, baseline server", nbytes,
                                lambda w, k=keys: lambda: base_tier.get(k[w % 16])),
                            ("peer put, baseline server", nbytes, lambda w, k=keys, b=blocks:
                                lambda: base_tier.put(k[w % 16], b[w % 16])),
                        ]
                    if rds is not None:
                        cells += [
                            ("redis get", nbytes, lambda w, k=f"k{label}": lambda: rds.get(k)),  # type: ignore[attr-defined]
                            ("redis set", nbytes, lambda w, k=f"s{label}", b=body:
                                lambda: rds.set(k, b)),  # type: ignore[attr-defined]
                        ]
                    if conc <= 8:
                        cells += [("peer batch16 get", 16 * nbytes,
                                   lambda w, k=keys: lambda: tier.get_many(k)),
                                  ("peer batch16 get, aiohttp server", 16 * nbytes,
                                   lambda w, k=keys: lambda: aio_tier.get_many(k))]
                    runs: dict[str, list[Result]] = {case: [] for case, _, _ in cells}
                    for _ in range(reps):  # round robin, so drift hits every system alike
                        for case, moved, make in cells:
                            pid = _server_of(case, server_pid)
                            before = _cpu_s(pid)
                            with prof.on() if case.startswith("peer") else contextlib.nullcontext():
                                await _cell(runs[case], case, label, moved, conc, make,
                                            min_time)
                            if pid is not None:
                                cell = runs[case][-1]
                                cell.extra["server_us_per_op"] = \
                                    (_cpu_s(pid) - before) / max(cell.ops, 1) * 1e6
                    results += [median_of(r) for r in runs.values()]
                    for raw in raws:
                        raw.tr.close()
                if mooncake is not None:
                    rows, why = await mooncake_baseline.measure(
                        mooncake, label, nbytes, [c for c in concs if c <= 8],
                        duration=min_time, reps=reps, warmup=0.05 if quick else 0.3)
                    if why:
                        print(f"mooncake baseline {label}: skipped: {why}")
                    results += rows
        if prof.prof is not None:
            _print_profile("client (this process), peer cells", pstats.Stats(prof.prof))
    return results


def _server_of(case: str, pids: dict[str, int]) -> int | None:
    """The child process serving ``case`` (``None`` for Redis, whose CPU is not compared)."""
    if case.startswith("peer"):
        for variant in (", aiohttp server", ", baseline server"):
            if case.endswith(variant):
                return pids[variant]
        return pids[""]
    if case == "tcp proto get":
        return pids["tcp"]
    return pids["aiohttp"] if case.startswith("aiohttp") else None


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds a child process has used so far (``/proc``)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_cpu(results: list[Result]) -> list[str]:
    """Server CPU per request: the peer server (data plane, aiohttp) and the baselines'."""
    lines = []
    for r in sorted(results, key=lambda r: (r.size, r.concurrency, r.case)):
        if "server_us_per_op" in r.extra:
            lines.append(f"{r.case:<34} {r.size:>6} c={r.concurrency:<3} "
                         f"{r.extra['server_us_per_op']:9.0f} us")
    return lines


async def _wait_port(port: int) -> None:
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection(HOST, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def _print_profile(title: str, stats: pstats.Stats) -> None:
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(14)
    print(f"\n## profile: {title}, top functions by own time")
    print("\n".join(out.getvalue().splitlines()[6:24]))


def _attach_ratios(results: list[Result]) -> None:
    by = {(r.case, r.size, r.concurrency): r for r in results}
    # "peer get" is also set against the raw TCP ceiling and Redis in the target lines.
    pairs = {"peer get": "aiohttp get", "peer put": "aiohttp put",
             "aiohttp get joined": "aiohttp get", "peer batch16 get": "peer get",
             "redis get": "aiohttp get", "redis set": "aiohttp put",
             "aiohttp get": "tcp proto get", "mooncake get_into": "aiohttp get",
             "mooncake batch_get_into": "mooncake get_into",
             "peer get, aiohttp server": "aiohttp get", "peer put, aiohttp server": "aiohttp put",
             "peer batch16 get, aiohttp server": "peer get, aiohttp server",
             "peer get, baseline server": "peer get", "peer put, baseline server": "peer put"}
    # Printed after the first ratio: the peer reads against Mooncake's matching reads.
    second = {"peer get": "mooncake get_into", "peer batch16 get": "mooncake batch_get_into"}
    for r in results:
        base = by.get((pairs.get(r.case, ""), r.size, r.concurrency))
        if base is not None:
            with_ratio(r, base)
        also = by.get((second.get(r.case, ""), r.size, r.concurrency))
        if also is not None:
            with_second_ratio(r, also)


def _targets(results: list[Result]) -> list[str]:
    by = {(r.case, r.size, r.concurrency): r for r in results}
    lines = []
    for case, base, goal in (("peer get", "redis get", 2.0), ("peer get", "aiohttp get", 0.9),
                             ("peer get", "tcp proto get", 0.6),
                             ("peer get", "peer get, aiohttp server", None),
                             ("peer put", "peer put, aiohttp server", None),
                             ("peer get", "peer get, baseline server", None),
                             ("peer put", "peer put, baseline server", None),
                             ("peer batch16 get", "peer batch16 get, aiohttp server", None),
                             ("peer batch16 get", "redis get", None),
                             ("peer batch16 get", "mooncake batch_get_into", 1.3),
                             ("peer get", "mooncake get_into", None)):
        a, b = by.get((case, "1MiB", 8)), by.get((base, "1MiB", 8))
        if a is None or b is None or not b.gbps:
            lines.append(f"{case} / {base} @1MiB c=8: n/a")
            continue
        ratio = a.gbps / b.gbps
        verdict = "" if goal is None else \
            f" (target >= {goal:.1f}x: {'met' if ratio >= goal else 'NOT met'})"
        lines.append(f"{case} / {base} @1MiB c=8: {a.gbps:.2f} / {b.gbps:.2f} GB/s = "
                     f"{ratio:.2f}x{verdict}")
    return lines


def run(quick: bool = False, profile: bool = False, sizes: dict[str, int] | None = None,
        server_loop: str = "auto", mooncake: str = "auto",
        baseline: Path | None = None, stamps_log: bool = False) -> list[Result]:
    """Run every cell (for ``sizes``, default all of SIZES; ``kvtier serve --loop
    server_loop``; the Mooncake cells per ``mooncake``: ``auto``, ``off`` or the path of
    ``bench_mooncake.py``; ``baseline``: a source tree whose ``kvtier serve`` the baseline
    server cells run against; ``stamps_log``: the servers keep a stamps log) and return
    the results (ratios attached)."""
    script, why = mooncake_baseline.resolve(mooncake)
    if script is None:
        print(f"mooncake baseline: skipped: {why}")
    results = asyncio.run(_run_all(quick, profile, SIZES if sizes is None else sizes,
                                   server_loop, script, baseline, stamps_log))
    _attach_ratios(results)
    return results


def _report(args: argparse.Namespace) -> tuple[list[Result], int]:
    sizes = {label: SIZES[label] for label in args.sizes}
    results = run(args.quick, args.profile, sizes, args.server_loop, args.mooncake,
                  args.baseline, args.stamps_log)
    for label in sizes:
        rows = sorted((r for r in results if r.size == label),
                      key=lambda r: (r.concurrency, r.case))
        print_table(rows, f"peer tier vs baselines, {label}")
    print("\n## server CPU per request (/proc utime+stime of the serving child over the "
          "median cell / its requests; a batch16 request moves 16 blocks)")
    for line in _server_cpu(results):
        print(line)
    print("\n## targets (same run)")
    for line in _targets(results):
        print(line)
    return results, 0


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the peer cells (client and server)")
    parser.add_argument("--sizes", type=_sizes, default=list(SIZES), metavar="LIST",
                        help=f"comma-separated block sizes to run (of {', '.join(SIZES)})")
    parser.add_argument("--server-loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop of the kvtier serve child (kvtier serve --loop)")
    parser.add_argument("--mooncake", default="auto", metavar="auto|off|PATH",
                        help="Mooncake Store baseline: run bench_mooncake.py at PATH, or "
                             "(auto) ../shared/bench/bench_mooncake.py from the repository "
                             "root when it exists and mooncake.store imports; off: skip it")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="also run the peer get/put cells against a kvtier serve from "
                             "this source tree (e.g. git archive main | tar -x -C DIR)")
    parser.add_argument("--stamps-log", action="store_true",
                        help="every server keeps a stamps log (kvtier serve --versions), as "
                             "beside an lmdb:// or file:// segment")


def _sizes(text: str) -> list[str]:
    labels = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SIZES]
    if unknown or not labels:
        raise argparse.ArgumentTypeError(f"--sizes: unknown size(s) {unknown}; "
                                         f"choose from {', '.join(SIZES)}")
    return labels


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``--quick``, ``--json FILE``, ``--profile``)."""
    return main_for(_report, __doc__.split("\n\n")[0], argv,
                    quick="short cells, concurrency 1/8", options=_options)


if __name__ == "__main__":
    sys.exit(main())
