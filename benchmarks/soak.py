"""Chaos soak of the peer pool: `kvtier serve` processes killed, restarted empty and frozen
while clients put and get blocks whose bytes derive from their key.

    python -m benchmarks.soak [--duration 180] [--concurrency 16] [--servers 3] [--replicas 2]
    kvtier bench --only soak [--full]          (quick: 25 s; --full: 180 s)

N servers (`kvtier serve --pool`, anti-entropy on, DRAM segments) run on loopback. One client
process runs `--concurrency` workers over `--clients` long-lived stores on ``peers://``
(``ack=all``), paced to `--rate` operations per second (a rate above what the box serves is
the overload setting; the table shows the rate reached): half put a new key, half get an
acknowledged one and check its bytes; of those, `--overwrites` and `--deletes` (a share each)
overwrite an acknowledged key with a second value or delete it instead. Every
`--chaos-interval` seconds the chaos loop either
SIGKILLs `--down-together` random servers and restarts them (empty: DRAM only) or SIGSTOPs
one for `--stop-seconds` and resumes it.

Optional faults: `--grow-shrink` starts with one member of the pool URL absent (it joins,
empty, a third into the run) and stops another for good two thirds into it (it stays out of
the final read); `--full-disk-mib M` gives server 0 an LMDB segment under a small DRAM tier on
a tmpfs of M MiB with an LMDB capacity of twice that (the disk fills; its restarts are warm,
the LMDB kept), skipped where a tmpfs cannot be mounted.

At the end every server is up (but the one `--grow-shrink` removed); every long-lived client
and a fresh client read back every acknowledged key, and the table counts the keys a
long-lived client missed that the fresh one read (with the long-lived clients' failed
requests meanwhile), and of those the keys still missed when read again batch by batch
beside a fresh client (a difference of view, not of the load; the exit status counts these).
An unreadable key that a second fresh client reads, a few keys a request, was held all along
(the first read-back's requests failed) and is not lost. An unreadable key counts as
"replication could not help" when `replicas` distinct servers were killed (or removed) after
its put was acknowledged, each within `--repair-grace` seconds of the previous (no
anti-entropy pass could have re-replicated in between); one all of whose owners' DRAM tiers
were evicting at the end (`--dram-capacity`, 2GiB, outgrown: LRU drops the oldest keys)
counts as lost to the budget (under `--placement local`, where copies are not on the ring
owners and a last copy is dropped only as the oldest block anywhere: only when a server
dropped blocks as the oldest and the key's last access, its ack or its last read, whichever
is later, is older than the youngest pool-blocks / replicas values' last accesses, which fit
the pool with all their copies: age as the holder defines it); every other unreadable key
is a loss replication should have prevented. A
second table shows each server's DRAM evictions and blocks and its anti-entropy counters
(from ``/metrics``) just before each kill and at the end. Wrong bytes and exceptions must be
0. Server RSS is shown at start and end, and at the end also less the bytes its DRAM tier
holds (the data it was given). Overwrites and deletes are checked at the end by the fresh
client: no acknowledged overwrite may read its first value ("stale"), no acknowledged delete
may read back ("undone"); an overwrite or delete that raised is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"kvtier serve listening on (\S+)")


def block_for(key: bytes, nbytes: int) -> np.ndarray:
    """The block stored under ``key``: bytes that derive from the key alone."""
    return np.frombuffer(hashlib.shake_128(key).digest(nbytes), dtype=np.uint8)


def second_block_for(key: bytes, nbytes: int) -> np.ndarray:
    """The value an overwrite stores under ``key`` (another than :func:`block_for`'s)."""
    return np.frombuffer(hashlib.shake_128(b"overwrite:" + key).digest(nbytes),
                         dtype=np.uint8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _dram_bytes(member: str, token: str) -> int:
    """Bytes the server's DRAM tiers hold (from its ``/v1/health``)."""
    request = urllib.request.Request(f"http://{member}/v1/health",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            doc = json.loads(answer.read())
    except OSError:
        return 0
    return sum(int(t.get("used") or 0) for t in doc.get("tiers", ())
               if t.get("scheme") == "dram")


_METRIC = re.compile(r"^(kvtier_peer_repair_\w+?|kvtier_store_evictions|kvtier_store_blocks"
                     r"|kvtier_peer_local_(?:forwarded|dropped_oldest|stale_holders|spares_reclaimed))"
                     r"(?:_total)?(?:\{[^}]*scheme=\"dram\"[^}]*\})? (\S+)$", re.M)
#: Per-server figures the soak reads from ``/metrics``: the DRAM tier's evictions and blocks,
#: the anti-entropy counters, and under placement=local the last copies forwarded, the
#: copies dropped as the oldest anywhere (the pool's budget), the stale directory entries
#: found and the spare copies dropped to make room.
FIGURES = ("evictions", "blocks", "passes", "checked", "pushed", "failed", "under_replicated",
           "standins_pruned", "forwarded", "dropped_oldest", "stale_holders",
           "spares_reclaimed")


def _figures(member: str, token: str) -> dict[str, float]:
    """The server's :data:`FIGURES` from its ``/metrics`` (empty if it does not answer)."""
    request = urllib.request.Request(f"http://{member}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        short = name.removeprefix("kvtier_peer_repair_").removeprefix("kvtier_store_") \
            .removeprefix("kvtier_peer_local_")
        out[short] = out.get(short, 0.0) + float(value)
    return out


@contextlib.contextmanager
def _tmpfs(path: Path, mib: int) -> Iterator[Path | None]:
    """A tmpfs of ``mib`` MiB at ``path`` (``None`` where mounting is not permitted)."""
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"full disk: skipped (cannot mount a tmpfs: {proc.stderr.strip()})", flush=True)
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _count_in_logs(workdir: Path, port: int, text: str) -> int:
    """How often ``text`` occurs in the logs of the server on ``port``."""
    return sum(path.read_text(errors="replace").count(text)
               for path in workdir.glob(f"serve-{port}-*.log"))


@dataclass
class Server:
    """One `kvtier serve` child on a fixed port (so a restart keeps its member id)."""

    port: int
    args: list[str]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False
    log_index: int = 0

    @property
    def member(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_index += 1
        log = open(self.workdir / f"serve-{self.port}-{self.log_index}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "serve", "--listen", self.member, *self.args],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.stopped = False

    async def wait_ready(self, within: float = 60.0) -> None:
        path = self.workdir / f"serve-{self.port}-{self.log_index}.log"
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if _LISTEN.search(path.read_text(errors="replace")):
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"server {self.member} did not start:\n{path.read_text()[-2000:]}")

    def send(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop_all(self) -> None:
        if self.proc is None:
            return
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Tally:
    puts: int = 0
    gets: int = 0
    acked: dict[bytes, float] = field(default_factory=dict)  # key -> ack time
    read: dict[bytes, float] = field(default_factory=dict)  # key -> its last get that hit
    chains: list[list[bytes]] = field(default_factory=list)  # acknowledged, with --chain > 1
    put_errors: int = 0
    get_errors: int = 0
    get_misses: int = 0
    wrong_bytes: int = 0
    put_lat: list[float] = field(default_factory=list)
    get_lat: list[float] = field(default_factory=list)
    kills: list[tuple[float, int]] = field(default_factory=list)
    overwritten: dict[bytes, float] = field(default_factory=dict)  # key -> overwrite ack
    deleted: dict[bytes, float] = field(default_factory=dict)  # key -> delete ack
    # key -> True (overwrite) / False (delete), from when the change started: a get that
    # was already in flight may read the new value (or miss) without anything being wrong.
    changing: dict[bytes, bool] = field(default_factory=dict)
    write_errors: int = 0  # overwrites and deletes that raised (their keys left out)
    # (time, server, "kill" | "end", its figures just before): see FIGURES
    figures: list[tuple[float, int, str, dict[str, float]]] = field(default_factory=list)
    stops: int = 0
    joins: int = 0
    leaves: int = 0
    errors: list[str] = field(default_factory=list)


async def _workers(stores: Sequence[object], tally: Tally, args: argparse.Namespace, until: float,
                   rng: random.Random) -> None:
    keys: list[bytes] = []
    reading: dict[bytes, int] = {}  # key -> gets of it in flight (never overwritten meanwhile)
    interval = args.concurrency / args.rate
    counter = iter(range(1 << 62))

    async def worker(w: int) -> None:
        store = stores[w % len(stores)]
        next_at = time.monotonic() + rng.random() * interval
        while time.monotonic() < until:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
            if args.chain > 1:
                await _chain_op(store, tally, args, rng, next(counter))
            elif keys and rng.random() < args.overwrites + args.deletes:
                # Taken out of the read pool first, and never one a get is reading: no get
                # races its change mid-run (a get in flight would read the new value).
                i = rng.randrange(len(keys))
                if keys[i] in reading:
                    continue
                key, keys[i] = keys[i], keys[-1]
                keys.pop()
                overwrite = rng.random() * (args.overwrites + args.deletes) < args.overwrites
                # A get of this key that started before may see the change (checked so).
                tally.changing[key] = overwrite
                try:
                    if overwrite:
                        await store.put(key, second_block_for(key, args.block_bytes))  # type: ignore[attr-defined]
                    else:
                        await store.delete(key)  # type: ignore[attr-defined]
                except Exception as exc:
                    tally.write_errors += 1
                    tally.errors.append(f"{'put' if overwrite else 'delete'}: {exc!r}"[:300])
                    tally.acked.pop(key, None)
                    continue
                tally.acked.pop(key, None)
                (tally.overwritten if overwrite else tally.deleted)[key] = time.monotonic()
            elif not keys or rng.random() < 0.5:
                key = hashlib.blake2b(f"soak-{args.seed}-{next(counter)}".encode(),
                                      digest_size=16).digest()
                t0 = time.perf_counter()
                try:
                    await store.put(key, block_for(key, args.block_bytes))  # type: ignore[attr-defined]
                except Exception as exc:
                    tally.put_errors += 1
                    tally.errors.append(f"put: {exc!r}"[:300])
                    continue
                tally.put_lat.append(time.perf_counter() - t0)
                tally.puts += 1
                tally.acked[key] = time.monotonic()
                keys.append(key)
            else:
                key = rng.choice(keys)
                t0 = time.perf_counter()
                reading[key] = reading.get(key, 0) + 1
                try:
                    got = await store.get(key)  # type: ignore[attr-defined]
                except Exception as exc:
                    tally.get_errors += 1
                    tally.errors.append(f"get: {exc!r}"[:300])
                    continue
                finally:
                    reading[key] -= 1
                    if not reading[key]:
                        del reading[key]
                tally.get_lat.append(time.perf_counter() - t0)
                tally.gets += 1
                if got is not None:
                    tally.read[key] = time.monotonic()
                change = tally.changing.get(key)
                if got is None:
                    if change is not False:  # a delete that raced this get: not a miss
                        tally.get_misses += 1
                elif not _right_bytes(key, got, args.block_bytes) and not (
                        change and _right_bytes(key, got, args.block_bytes, second=True)):
                    tally.wrong_bytes += 1
                    tally.errors.append(f"get: wrong bytes for {key.hex()}")

    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))


def _right_bytes(key: bytes, got: object, nbytes: int, *, second: bool = False) -> bool:
    """Whether a block read back for ``key`` holds the bytes its put wrote (``second``: its
    overwrite's)."""
    want = second_block_for(key, nbytes) if second else block_for(key, nbytes)
    return bool(np.array_equal(np.asarray(got).view(np.uint8).ravel(), want))


async def _chain_op(store: object, tally: Tally, args: argparse.Namespace,
                    rng: random.Random, serial: int) -> None:
    """Half the time put a new prompt chain of ``--chain`` blocks (one ``put_many``), else
    read an acknowledged chain back with ``get_many`` (as an engine loads a prompt)."""
    if not tally.chains or rng.random() < 0.5:
        chain = [hashlib.blake2b(f"soak-{args.seed}-{serial}-{i}".encode(),
                                 digest_size=16).digest() for i in range(args.chain)]
        t0 = time.perf_counter()
        try:
            await store.put_many([(k, block_for(k, args.block_bytes)) for k in chain])  # type: ignore[attr-defined]
        except Exception as exc:
            tally.put_errors += 1
            tally.errors.append(f"put_many: {exc!r}"[:300])
            return
        tally.put_lat.append(time.perf_counter() - t0)
        tally.puts += len(chain)
        now = time.monotonic()
        tally.acked.update((k, now) for k in chain)
        tally.chains.append(chain)
        return
    chain = rng.choice(tally.chains)
    t0 = time.perf_counter()
    try:
        got = await store.get_many(chain)  # type: ignore[attr-defined]
    except Exception as exc:
        tally.get_errors += 1
        tally.errors.append(f"get_many: {exc!r}"[:300])
        return
    tally.get_lat.append(time.perf_counter() - t0)
    tally.gets += len(chain)
    for key, block in zip(chain, got, strict=True):
        if block is None:
            tally.get_misses += 1
        elif not _right_bytes(key, block, args.block_bytes):
            tally.wrong_bytes += 1


async def _chaos(servers: list[Server], tally: Tally, args: argparse.Namespace, until: float,
                 rng: random.Random, out: set[int], faults: asyncio.Lock) -> None:
    """Faults every `--chaos-interval` s; ``out`` holds the servers the membership loop
    keeps out (never picked); ``faults`` is held during each fault."""
    kill_next = True
    while time.monotonic() + args.chaos_interval < until:
        await asyncio.sleep(args.chaos_interval)
        async with faults:
            kill_next = await _fault(servers, tally, args, rng, out, kill_next)


async def _fault(servers: list[Server], tally: Tally, args: argparse.Namespace,
                 rng: random.Random, out: set[int], kill_next: bool) -> bool:
    candidates = [i for i in range(len(servers)) if i not in out]
    if kill_next:
        picked = rng.sample(candidates, min(args.down_together, len(candidates)))
        for index in picked:
            tally.figures.append((time.monotonic(), index, "kill", await asyncio.to_thread(
                _figures, servers[index].member, "soak-token")))
            servers[index].kill()
            tally.kills.append((time.monotonic(), index))
        await asyncio.sleep(rng.uniform(0.5, 3.0))
        for index in picked:
            servers[index].start()
        for index in picked:
            await servers[index].wait_ready()
    else:
        victim = servers[rng.choice(candidates)]
        victim.send(signal.SIGSTOP)
        tally.stops += 1
        await asyncio.sleep(args.stop_seconds)
        victim.send(signal.SIGCONT)
    return not kill_next


async def _membership(servers: list[Server], tally: Tally, t0: float, duration: float,
                      out: set[int], faults: asyncio.Lock) -> None:
    """`--grow-shrink`: server 0 (absent from the start) joins empty a third into the run;
    the last server leaves for good two thirds into it."""
    await asyncio.sleep(max(0.0, t0 + duration / 3 - time.monotonic()))
    async with faults:
        servers[0].start()
        await servers[0].wait_ready()
        out.discard(0)
        tally.joins += 1
    await asyncio.sleep(max(0.0, t0 + 2 * duration / 3 - time.monotonic()))
    async with faults:
        leaving = len(servers) - 1
        out.add(leaving)
        servers[leaving].kill()
        tally.kills.append((time.monotonic(), leaving))
        tally.leaves += 1


async def _read_back(store: object, batches: list[list[bytes]], nbytes: int
                     ) -> tuple[set[bytes], int]:
    """``(keys read with the right bytes, wrong blocks)`` of the keys in ``batches`` (each
    one ``get_many``: a chain is read as one prompt) through ``store``."""
    good: set[bytes] = set()
    wrong = 0
    for chunk in batches:
        for key, got in zip(chunk, await store.get_many(chunk), strict=True):  # type: ignore[attr-defined]
            if got is None:
                continue
            if _right_bytes(key, got, nbytes):
                good.add(key)
            else:
                wrong += 1
    return good, wrong


def _failed_requests(store: object) -> int:
    """Requests of ``store``'s pool tier that failed so far (timed out, refused, 5xx)."""
    return int(store.tiers[0].counts["errors"])  # type: ignore[attr-defined]


async def _stale_and_undone(store: object, tally: Tally, nbytes: int) -> tuple[int, int, int]:
    """``(overwrites read at their first value, deletes read back, overwrites unreadable)``
    through ``store``."""
    stale = undone = missing = 0
    over = list(tally.overwritten)
    for start in range(0, len(over), 64):
        chunk = over[start:start + 64]
        for key, got in zip(chunk, await store.get_many(chunk), strict=True):  # type: ignore[attr-defined]
            if got is None:
                missing += 1
            elif not np.array_equal(np.asarray(got).view(np.uint8).ravel(),
                                    second_block_for(key, nbytes)):
                stale += 1
    gone = list(tally.deleted)
    for start in range(0, len(gone), 64):
        chunk = gone[start:start + 64]
        undone += sum(1 for got in await store.get_many(chunk) if got is not None)  # type: ignore[attr-defined]
    return stale, undone, missing


def _excused(acked_at: float, kills: list[tuple[float, int]], replicas: int,
             grace: float) -> bool:
    """Whether ``replicas`` distinct servers were killed after the ack, each within ``grace``
    seconds of the previous kill (too fast for re-replication in between)."""
    after = [(t, i) for t, i in kills if t >= acked_at]
    for start in range(len(after)):
        seen = {after[start][1]}
        last = after[start][0]
        for t, i in after[start + 1:]:
            if t - last > grace:
                break
            if i not in seen:
                seen.add(i)
            last = t
            if len(seen) >= replicas:
                return True
        if len(seen) >= replicas:
            return True
    return replicas <= 1 and bool(after)


def _oldest_dropped(unreadable: list[bytes], tally: Tally, args: argparse.Namespace
                    ) -> list[bytes]:
    """Under ``--placement local``, the ``unreadable`` keys lost to the pool's budget: a
    copy is not on the key's ring owners but wherever it was computed or forwarded, and a
    last copy may be dropped only as the oldest block anywhere. So a key counts when some
    server dropped blocks as the oldest (``dropped_oldest``) and the key is older than the
    youngest ``pool blocks / replicas`` values acknowledged (puts and overwrites): those fit
    the pool with every copy even were everything older dropped, so none of them is the
    oldest anywhere, and losing one is a replication failure whatever the pool's fill.
    Age is the holder's (:mod:`kvtier.peer.holder`): the time since a value's last access,
    its ack or the last get of it that hit, whichever is later."""
    dropped = sum(f.get("dropped_oldest", 0.0) for _, _, _, f in tally.figures)
    if not dropped:
        return []
    fit = args.servers * _size(args.dram_capacity) // args.block_bytes // args.replicas

    def last_access(key: bytes, acked: float) -> float:
        return max(acked, tally.read.get(key, acked))

    stored = sorted([*(last_access(k, t) for k, t in tally.acked.items()),
                     *(last_access(k, t) for k, t in tally.overwritten.items())])
    if len(stored) <= fit:
        return []
    cutoff = stored[-fit]
    return [k for k in unreadable if last_access(k, tally.acked[k]) < cutoff]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


async def soak(args: argparse.Namespace) -> dict[str, object]:
    """Run the soak; returns the figures the table prints."""
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    with _tmpfs(workdir / "disk", args.full_disk_mib) if args.full_disk_mib else \
            contextlib.nullcontext() as disk:
        return await _soak(args, workdir, disk)


async def _soak(args: argparse.Namespace, workdir: Path, disk: Path | None
                ) -> dict[str, object]:
    import kvtier
    from kvtier.peer.client import PeerClient

    rng = random.Random(args.seed)
    token = workdir / "token"
    token.write_text("soak-token\n")
    ports = [_free_port() for _ in range(args.servers)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    pool = (f"peers://{members}?replicas={args.replicas}&token=file:{token}"
            f"&timeout={args.timeout}&health_interval=0.5&placement={args.placement}")
    # prefault=0: a prefaulted 2 GiB arena would put the whole capacity in every server's RSS
    # from its first seconds on, hiding the growth (a leak) that the RSS rows look for.
    serve_args = ["--tier", f"dram://?capacity={args.dram_capacity}&prefault=0",
                  "--token-file", str(token)]
    if args.repair_interval > 0:
        serve_args += ["--pool", pool, "--repair-interval", str(args.repair_interval)]
    servers = [Server(p, serve_args, workdir) for p in ports]
    if disk is not None:  # server 0: a small DRAM tier over an LMDB that fills its tmpfs
        lmdb = f"lmdb://{disk}/seg?capacity={2 * args.full_disk_mib}MiB"
        servers[0].args = ["--tier", "dram://?capacity=8MiB", "--tier", lmdb,
                           *serve_args[2:]]
    out: set[int] = {0} if args.grow_shrink else set()
    tally = Tally()
    try:
        for i, s in enumerate(servers):
            if i not in out:
                s.start()
        for i, s in enumerate(servers):
            if i not in out:
                await s.wait_ready()
        rss_start = {i: _rss_mib(s.proc.pid) for i, s in enumerate(servers) if s.proc}
        # Under placement=local each client is attached to its own home member.
        stores = [await kvtier.open_store(
            [pool + (f"&home=127.0.0.1:{ports[i % len(ports)]}"
                     if args.placement == "local" else "")]) for i in range(args.clients)]
        t0 = time.monotonic()
        until = t0 + args.duration
        try:
            lock = asyncio.Lock()
            faults = [_chaos(servers, tally, args, until, rng, out, lock)]
            if args.grow_shrink:
                faults.append(_membership(servers, tally, t0, args.duration, out, lock))
            await asyncio.gather(_workers(stores, tally, args, until, rng), *faults)
            wall = time.monotonic() - t0
            client_stats = stores[0].stats()["tiers"][0]
            for s in servers:
                s.send(signal.SIGCONT)
            await asyncio.sleep(args.settle)
            keys = list(tally.acked)
            batches = tally.chains if args.chain > 1 else [
                keys[start:start + 64] for start in range(0, len(keys), 64)]
            # Long-lived clients first, then a fresh one, all servers up (but the one left).
            failed_before = sum(_failed_requests(s) for s in stores)
            long_lived = [await _read_back(store, batches, args.block_bytes)
                          for store in stores]
            # Their requests that failed (timed out, refused, 5xx) while they read back.
            long_failures = sum(_failed_requests(s) for s in stores) - failed_before
            # What they missed, read again batch by batch beside a fresh client (each batch
            # through the long-lived client, then at once the fresh one): a key still missed
            # there that the fresh client reads is a difference of view, not of the load.
            async with await kvtier.open_store([pool]) as beside:
                still_behind = 0
                for store, (good, _) in zip(stores, long_lived, strict=True):
                    missed = [k for k in keys if k not in good]
                    for start in range(0, len(missed), 64):
                        chunk = [missed[start:start + 64]]
                        reread, _ = await _read_back(store, chunk, args.block_bytes)
                        fresh_read, _ = await _read_back(beside, chunk, args.block_bytes)
                        still_behind += len(fresh_read - reread)
        finally:
            for store in stores:
                await store.aclose()
        rss_end = {i: _rss_mib(s.proc.pid) for i, s in enumerate(servers)
                   if s.proc and s.proc.poll() is None}
        held_mib = {i: _dram_bytes(servers[i].member, "soak-token") / (1 << 20)
                    for i in rss_end}
        for i in rss_end:
            tally.figures.append((time.monotonic(), i, "end", await asyncio.to_thread(
                _figures, servers[i].member, "soak-token")))
        # The servers whose DRAM tier evicts (full): LRU drops their least recent blocks.
        evicting = {servers[i].member for _, i, when, f in tally.figures
                    if when == "end" and f.get("evictions", 0) > 0}
        async with await kvtier.open_store([pool]) as reader:
            fresh, wrong_end = await _read_back(reader, batches, args.block_bytes)
            # Requests of the fresh read-back that failed (timed out, refused, 5xx): a key
            # whose every holder failed its request is unreadable though held.
            read_failures = _failed_requests(reader)
            stale, undone, over_missing = await _stale_and_undone(reader, tally,
                                                                  args.block_bytes)
        behind = sum(len(fresh - good) for good, _ in long_lived)
        wrong_end += sum(wrong for _, wrong in long_lived)
        unreadable = [k for k in keys if k not in fresh]
        held = 0
        late_read: set[bytes] = set()
        if unreadable:  # which unreadable keys some live server still holds
            clients = [PeerClient(servers[i].member, token="soak-token", timeout=5.0)
                       for i in rss_end]
            try:
                flags = [await c.exists_many(unreadable) for c in clients]
            finally:
                for c in clients:
                    await c.close()
            held = sum(1 for row in zip(*flags, strict=True) if any(row))
            # A second fresh client, a few keys a request: the keys it reads were held all
            # along and missed only because the requests of the first read-back failed.
            async with await kvtier.open_store([pool]) as again:
                late_read, wrong_late = await _read_back(
                    again, [unreadable[i:i + 8] for i in range(0, len(unreadable), 8)],
                    args.block_bytes)
            wrong_end += wrong_late
        excused = sum(1 for k in unreadable if k not in late_read
                      and _excused(tally.acked[k], tally.kills, args.replicas, args.repair_grace))
        # Each avoidable loss: its owners (server indexes), ack time and the kills after it.
        from kvtier.peer.ring import HashRing

        ring = HashRing([s.member for s in servers])
        index = {s.member: i for i, s in enumerate(servers)}
        not_excused = [k for k in unreadable if k not in late_read
                       and not _excused(tally.acked[k], tally.kills, args.replicas,
                                        args.repair_grace)]
        # Every owner evicting: the loss is the DRAM budget's (the pool holds fewer blocks
        # than the acknowledged keys' copies), correct behaviour, not a replication failure.
        if args.placement == "local":
            budget = _oldest_dropped(not_excused, tally, args)
        else:
            budget = [k for k in not_excused
                      if all(m in evicting for m in ring.owners(k, args.replicas))]
        lost_to_budget = set(budget)
        avoidable = [k for k in not_excused if k not in lost_to_budget]
        on_full_disk = sum(1 for k in avoidable
                           if disk is not None and servers[0].member in ring.owners(
                               k, args.replicas))
        losses = [f"{k.hex()[:12]} owners {[index[m] for m in ring.owners(k, args.replicas)]} "
                  f"acked t={tally.acked[k] - t0:.1f} kills after "
                  f"{[(round(t - t0, 1), i) for t, i in tally.kills if t >= tally.acked[k]]}"
                  for k in avoidable]
        dropped = _count_in_logs(workdir, servers[0].port, "failed demote")
    finally:
        for s in servers:
            s.stop_all()
    return {
        "args": args, "tally": tally, "wall": wall, "rss_start": rss_start, "rss_end": rss_end,
        "held_mib": held_mib, "unreadable": len(unreadable), "excused": excused, "held": held,
        "wrong": tally.wrong_bytes + wrong_end, "client": client_stats, "behind": behind,
        "long_failures": long_failures, "still_behind": still_behind,
        "full_disk": disk is not None, "losses": losses, "dropped": dropped,
        "on_full_disk": on_full_disk, "t0": t0, "budget": len(budget),
        "stale": stale, "undone": undone, "over_missing": over_missing,
        "late": len(late_read), "read_failures": read_failures,
    }


def table(r: dict[str, object]) -> str:
    """The soak's figures as a markdown table."""
    a: argparse.Namespace = r["args"]  # type: ignore[assignment]
    t: Tally = r["tally"]  # type: ignore[assignment]
    c: dict[str, object] = r["client"]  # type: ignore[assignment]
    unreadable, excused = int(r["unreadable"]), int(r["excused"])  # type: ignore[call-overload]
    start: dict[int, float] = r["rss_start"]  # type: ignore[assignment]
    end: dict[int, float] = r["rss_end"]  # type: ignore[assignment]
    held: dict[int, float] = r["held_mib"]  # type: ignore[assignment]
    wall = float(r["wall"])  # type: ignore[arg-type]
    done = t.puts + t.gets + t.put_errors + t.get_errors
    rows = [
        ("duration (s), servers, replicas, concurrency, long-lived clients",
         f"{wall:.0f}, {a.servers}, {a.replicas}, {a.concurrency}, {a.clients}"),
        ("operations/s asked / reached", f"{a.rate:.0f} / {done / wall:.0f}"),
        (f"chaos: servers SIGKILLed+restarted ({a.down_together} at once) / SIGSTOPs",
         f"{len(t.kills) - t.leaves} / {t.stops}"),
        ("membership: joined empty / left for good", f"{t.joins} / {t.leaves}"),
        ("full disk (server 0: LMDB on a tmpfs): size / demotions it failed",
         f"{a.full_disk_mib} MiB / {r['dropped']}" if r["full_disk"] else "off"),
        ("placement, blocks per put", f"{a.placement}, {a.chain}"),
        ("operations: puts acknowledged / gets", f"{t.puts} / {t.gets}"),
        ("gets that missed during chaos", f"{t.get_misses}"),
        ("acknowledged keys unreadable at end (all servers up)",
         f"{unreadable} of {len(t.acked)} (still held by a live server: {r['held']})"),
        ("  of which a second fresh client read (held; the first read-back's requests "
         "failed: read failures)", f"{r['late']} ({r['read_failures']})"),
        ("  of which every holder was killed (replication could not help)", f"{excused}"),
        ("  of which every owner's DRAM was evicting (local: dropped as the oldest, older than "
         "the youngest pool-blocks / replicas values), lost to the budget",
         f"{r['budget']}"),
        ("  of which replication should have prevented (lost)",
         f"{unreadable - int(r['late']) - excused - int(r['budget'])}"),  # type: ignore[call-overload]
        ("    of those, owned by the full-disk server",
         f"{r['on_full_disk']}"),
        ("DRAM evictions (every server process) / pool DRAM blocks / acked keys x replicas",
         f"{_evictions(t):.0f} / {a.servers * _size(a.dram_capacity) // a.block_bytes} / "
         f"{len(t.acked) * a.replicas}"),
        ("wrong bytes returned", f"{r['wrong']}"),
        ("overwrites / deletes acknowledged (raised: left out)",
         f"{len(t.overwritten)} / {len(t.deleted)} ({t.write_errors})"),
        ("acked overwrites read stale / unreadable at end; acked deletes read back",
         f"{r['stale']} / {r['over_missing']}; {r['undone']}"),
        ("keys long-lived clients missed that a fresh client read (their failed requests "
         "then)", f"{r['behind']} ({r['long_failures']})"),
        ("  of which still missed when read again beside a fresh client that read them",
         f"{r['still_behind']}"),
        ("exceptions from put / get", f"{t.put_errors} / {t.get_errors}"),
        ("put latency p50 / p99 / max (ms)",
         f"{_pct(t.put_lat, 0.5):.1f} / {_pct(t.put_lat, 0.99):.1f} / "
         f"{max(t.put_lat, default=0) * 1e3:.1f}"),
        ("get latency p50 / p99 / max (ms)",
         f"{_pct(t.get_lat, 0.5):.1f} / {_pct(t.get_lat, 0.99):.1f} / "
         f"{max(t.get_lat, default=0) * 1e3:.1f}"),
        ("server RSS start -> end (MiB)",
         " ; ".join(f"{start[i]:.0f} -> {e:.0f}" if i in start else f"(joined) {e:.0f}"
                    for i, e in end.items())),
        ("server RSS at end less its DRAM-held data (MiB)",
         " ; ".join(f"{e - held[i]:.0f}" for i, e in end.items())),
        ("client: read repairs / walk hits / copies made / under-replicated puts",
         f"{c.get('read_repairs', 0)} / {c.get('walk_hits', 0)} / {c.get('copies_made', 0)} / "
         f"{c.get('puts_under_replicated', 0)}"),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"| {'soak':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    out += [f"| {k:<{width}} | {v} |" for k, v in rows]
    if t.errors:
        out.append("first exceptions: " + "; ".join(t.errors[:3]))
    losses: list[str] = r["losses"]  # type: ignore[assignment]
    if losses:
        out.append("avoidable losses (first 5): " + "; ".join(losses[:5]))
    return "\n".join(out) + "\n\n" + figures_table(t, float(r["t0"]))  # type: ignore[arg-type]


def _evictions(t: Tally) -> float:
    """DRAM evictions over every server process: each killed one's just before its kill,
    each live one's at the end."""
    return sum(f.get("evictions", 0.0) for _, _, _, f in t.figures)


def _size(text: str) -> int:
    from kvtier.urls import parse_size

    return int(parse_size(text, "--dram-capacity"))


def figures_table(t: Tally, t0: float) -> str:
    """Each server's DRAM evictions and blocks and its anti-entropy counters, just before
    each kill (what the killed process had done) and at the end."""
    head = ["t (s)", "server", "when", *FIGURES]
    rows = [[f"{at - t0:.1f}", str(i), when,
             *(f"{f[name]:.0f}" if name in f else "-" for name in FIGURES)]
            for at, i, when, f in sorted(t.figures, key=lambda row: (row[2], row[1], row[0]))]
    widths = [max(len(row[c]) for row in [head, *rows]) for c in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) + " |"
              for row in rows]
    return "\n".join(lines)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of chaos")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rate", type=float, default=100.0, help="operations per second")
    parser.add_argument("--block-bytes", type=int, default=16 << 10)
    parser.add_argument("--chaos-interval", type=float, default=15.0)
    parser.add_argument("--stop-seconds", type=float, default=3.0)
    parser.add_argument("--dram-capacity", default="2GiB",
                        help="each server's DRAM tier capacity (the blocks beyond it are "
                             "evicted, oldest first)")
    parser.add_argument("--repair-interval", type=float, default=5.0,
                        help="servers' anti-entropy interval (0: no --repair)")
    parser.add_argument("--repair-grace", type=float, default=12.0,
                        help="kills closer than this are 'too fast for re-replication'")
    parser.add_argument("--timeout", type=float, default=1.0, help="per-peer request timeout")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between the last fault and the read-back")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=2,
                        help="long-lived client stores the workers share")
    parser.add_argument("--down-together", type=int, default=1,
                        help="servers each SIGKILL fault takes down at once")
    parser.add_argument("--grow-shrink", action="store_true",
                        help="one member joins empty a third in; another leaves for good "
                             "two thirds in")
    parser.add_argument("--full-disk-mib", type=int, default=0,
                        help="server 0's LMDB segment on a tmpfs of this size (0: off)")
    parser.add_argument("--placement", default="block",
                        help="the pool's placement= (block, local: client i's home is "
                             "server i)")
    parser.add_argument("--chain", type=int, default=1,
                        help="blocks per put: > 1 puts and reads whole prompt chains")
    parser.add_argument("--overwrites", type=float, default=0.05,
                        help="share of operations that overwrite an acknowledged key")
    parser.add_argument("--deletes", type=float, default=0.05,
                        help="share of operations that delete an acknowledged key")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options(parser)
    args = parser.parse_args(argv)
    result = asyncio.run(soak(args))
    print(table(result))
    t: Tally = result["tally"]  # type: ignore[assignment]
    bad = (int(result["unreadable"]) - int(result["late"])  # type: ignore[call-overload]
           - int(result["excused"])  # type: ignore[call-overload]
           - int(result["budget"])  # type: ignore[call-overload]
           + int(result["wrong"]) + int(result["still_behind"])  # type: ignore[call-overload]
           + int(result["stale"]) + int(result["undone"])  # type: ignore[call-overload]
           + t.put_errors + t.get_errors)
    return 1 if bad else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
