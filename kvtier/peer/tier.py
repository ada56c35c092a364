"""``peers://`` and ``peers+dns://``: the pool of other hosts' segments as one tier.

A key's owners are its first ``replicas`` live members in ring order. ``get`` asks them in
that order and the first verified hit wins; a dead, slow or erroring peer is a miss (and is
taken out of the path until a health probe succeeds), never an exception or a hang. ``put``
writes every owner concurrently, falling to the next live member when one fails. Batch forms
send one request per owner, in parallel. When an owner is this node (``self=``) its segment
(``local=``) is used directly, without HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Self, TypeVar, cast

from kvtier.codec import EncodedFrame, decode_frame, encode_frame
from kvtier.codec import parse_compress as _compress_level
from kvtier.errors import ConfigError, CorruptBlockError, KVTierError, PeerError
from kvtier.peer import protocol as proto
from kvtier.peer.client import PeerClient
from kvtier.peer.frames import decode_from_peer
from kvtier.peer.locate import LocalPrefix, locate_prefix
from kvtier.peer.membership import Membership, split_member
from kvtier.peer.ring import DEFAULT_VNODES
from kvtier.peer.server import Segment
from kvtier.peer.tls import client_context
from kvtier.tiers.base import Block, Tier
from kvtier.urls import merge_options, parse_secret, parse_tier_url

__all__ = ["PeerTier"]

log = logging.getLogger("kvtier.peer.tier")
T = TypeVar("T")
_OPTIONS = {"replicas", "token", "self", "local", "timeout", "ack", "tls_ca", "tls_cert",
            "tls_key", "tls_server_name", "compress", "health_interval", "dns_interval",
            "vnodes", "pool", "name", "max_batch", "max_body"}
_FAILED = object()  # a peer that did not answer (distinct from a clean miss, ``None``)


def _number(value: object, name: str, cast: Callable[[str], T], low: float) -> T:
    try:
        out = cast(str(value))
    except ValueError:
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if out < low:  # type: ignore[operator]
        raise ConfigError(f"{name}: expected >= {low}, got {value!r}")
    return out


class PeerTier(Tier):
    """The peer pool as a tier.

    Parameters
    ----------
    members
        Static member ids (``host:port``), or ``None`` with ``dns``.
    dns
        ``(name, port)`` re-resolved every ``dns_interval`` seconds (``peers+dns://``).
    replicas
        Owners per key.
    token
        Bearer token of the pool (``None`` for servers run with ``--insecure-no-auth``).
    self_id
        This node's member id; with ``local`` its keys are served without HTTP.
    local
        This node's segment (the store or tier its ``PeerServer`` exposes).
    timeout
        Seconds allowed for one request to one peer; a slower peer is a miss.
    ack
        ``"all"``: ``put`` waits for every owner; ``"one"``: it returns after the first
        acknowledgement and the other copies complete in the background.
    ssl_context
        Client TLS context (see :func:`kvtier.peer.tls.client_context`).
    tls_server_name
        Name every member's certificate must carry (default: the member's host); for
        ``peers+dns://``, whose members are IP addresses.
    compress_level
        zstd level for blocks sent by ``put`` (``None``: raw, zero-copy).
    health_interval, dns_interval
        Seconds between health probes and between DNS re-resolutions.
    vnodes
        Virtual nodes per member on the ring.
    pool_limit
        Connections per peer.
    limits
        The servers' limits, used to split batches.

    Examples
    --------
    ``peers://h1:7070,h2:7070?replicas=2&token=env:KVTIER_TOKEN&self=h1:7070&timeout=0.5``
    """

    scheme = "peers"
    shared = True

    def __init__(self, members: Sequence[str] | None = None, *,
                 dns: tuple[str, int] | None = None, replicas: int = 1,
                 token: str | None = None, self_id: str | None = None,
                 local: Segment | None = None, timeout: float = 0.5, ack: str = "all",
                 ssl_context: ssl.SSLContext | None = None, compress_level: int | None = None,
                 health_interval: float = 2.0, dns_interval: float = 5.0,
                 vnodes: int = DEFAULT_VNODES, pool_limit: int = 64,
                 limits: proto.Limits | None = None, name: str | None = None,
                 tls_server_name: str | None = None) -> None:
        super().__init__(name=name or ("peers+dns" if dns else "peers"))
        if ack not in ("one", "all"):
            raise ConfigError(f"ack: expected 'one' or 'all', got {ack!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout!r}")
        if local is not None and self_id is None:
            raise ConfigError("local: requires self (this node's member id)")
        if members is not None and self_id is not None and self_id not in members:
            raise ConfigError(f"self: {self_id!r} is not one of the members {list(members)}")
        self.replicas = replicas
        self.timeout = timeout
        self._token = token  # for /v1/locate (the clients hold their own copy)
        self._ssl_context = ssl_context
        self.ack = ack
        self.compress_level = compress_level
        self.local = local
        self.limits = limits or proto.Limits()
        self.members = Membership(
            members, dns=dns, vnodes=vnodes, replicas=replicas, self_id=self_id,
            health_interval=health_interval, dns_interval=dns_interval,
            client_factory=lambda m: PeerClient(m, token=token, timeout=timeout,
                                                ssl_context=ssl_context,
                                                pool_limit=pool_limit, limits=self.limits,
                                                tls_server_name=tls_server_name))
        self._start_lock = asyncio.Lock()
        self._started = False
        self._background: set[asyncio.Task[bool]] = set()
        self.counts: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------------ config
    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``peers://h1:port,h2:port?...`` or ``peers+dns://name:port?...`` (see class doc)."""
        parsed = parse_tier_url(url)
        if parsed.scheme not in ("peers", "peers+dns"):
            raise ConfigError(f"url: expected peers:// or peers+dns://, got {url!r}")
        if parsed.path not in ("", "/"):
            raise ConfigError(f"url: {parsed.scheme}:// takes no path, got {url!r}")
        opts = merge_options(parsed, options, _OPTIONS)
        entries = [m.strip() for m in parsed.netloc.split(",") if m.strip()]
        if not entries:
            raise ConfigError(f"url: no peers in {url!r}")
        for entry in entries:
            split_member(entry, "url")
        dns = None
        if parsed.scheme == "peers+dns":
            if len(entries) != 1:
                raise ConfigError(f"url: peers+dns:// takes one name:port, got {parsed.netloc!r}")
            dns = split_member(entries[0], "url")
        tls = {k: str(opts[k]) for k in ("tls_ca", "tls_cert", "tls_key", "tls_server_name")
               if opts.get(k)}
        # Any TLS option, a server name included, means https (system roots without tls_ca).
        ctx = client_context(tls.get("tls_ca"), tls.get("tls_cert"), tls.get("tls_key")) \
            if tls else None
        token = opts.get("token")
        limits = proto.Limits(
            max_batch=_number(opts.get("max_batch", proto.Limits.max_batch), "max_batch", int, 1),
            max_body_bytes=_number(opts.get("max_body", proto.Limits.max_body_bytes),
                                   "max_body", int, proto.Limits.max_block_bytes))
        return cls(
            None if dns else entries, dns=dns,
            replicas=_number(opts.get("replicas", 1), "replicas", int, 1),
            token=None if token in (None, "") else parse_secret(str(token), "token"),
            self_id=str(opts["self"]) if opts.get("self") else None,
            local=opts.get("local"),  # type: ignore[arg-type]
            timeout=_number(opts.get("timeout", 0.5), "timeout", float, 0.001),
            ack=str(opts.get("ack", "all")),
            ssl_context=ctx,
            compress_level=_compress_level(opts.get("compress", "")),
            health_interval=_number(opts.get("health_interval", 2.0), "health_interval",
                                    float, 0.01),
            dns_interval=_number(opts.get("dns_interval", 5.0), "dns_interval", float, 0.01),
            vnodes=_number(opts.get("vnodes", DEFAULT_VNODES), "vnodes", int, 1),
            pool_limit=_number(opts.get("pool", 64), "pool", int, 1),
            limits=limits,
            name=str(opts["name"]) if opts.get("name") else None,
            tls_server_name=tls.get("tls_server_name"),
        )

    @property
    def capacity(self) -> int | None:
        # The budget lives on the peers; this node enforces none.
        return None

    @property
    def used(self) -> int:
        """Bytes held across the pool, from the last health probes (and the local segment)."""
        remote = sum(int(doc.get("used") or 0) for m, doc in self.members.health.items()
                     if m != self.members.self_id)
        return remote + int(getattr(self.local, "used", 0) or 0)

    async def _start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if not self._started:
                await self.members.start()
                self._started = True

    def _is_local(self, member: str) -> bool:
        return self.local is not None and member == self.members.self_id

    async def _call(self, member: str, op: str, fn: Callable[[], Awaitable[T]]) -> T | object:
        """Run one peer call; a failure marks the member down and returns ``_FAILED``."""
        self.counts[f"{op}_requests"] += 1
        try:
            return await fn()
        except asyncio.CancelledError:
            raise
        except (KVTierError, OSError) as exc:
            self.counts["errors"] += 1
            if not self._is_local(member):
                self.members.mark_dead(member, exc)
            log.debug("peer %s: %s failed: %s", member, op, exc)
            return _FAILED

    async def _decode(self, member: str, key: bytes,
                      frame: bytes | memoryview | None) -> Block | None:
        if frame is None:
            return None
        try:
            return await decode_from_peer(frame, key, self.limits.max_block_bytes)
        except CorruptBlockError as exc:
            self.counts["corrupt"] += 1
            log.warning("peer %s sent a corrupt frame: %s", member, exc)
            return None

    def _next(self, order: list[str], tried: set[str]) -> str | None:
        for member in order:
            if member not in tried and self.members.alive(member):
                return member
        return None

    # ----------------------------------------------------------------- single
    async def _get(self, key: bytes) -> Block | None:
        return (await self._get_many([key]))[0]

    async def _contains(self, key: bytes) -> bool:
        return (await self._contains_many([key]))[0]

    async def _put(self, key: bytes, block: Block) -> None:
        await self._start()
        frame = await self._encode(block)
        order = self.members.order(key)
        targets = self.members.live_owners(key, self.replicas)
        if not targets:
            raise PeerError(f"{self.name}: no live peer to store {key.hex()}")
        if self.ack == "one" and len(targets) > 1 and not self.compress_level:
            # Copies finish after put() returns: they must not read the caller's buffer.
            frame = EncodedFrame(frame.header, memoryview(frame.payload.tobytes()))
            block = decode_frame(frame.to_bytes())
        used = set(targets)
        tasks = [asyncio.create_task(self._write_one(key, block, frame, first, order, used))
                 for first in targets]
        if self.ack == "all":
            done = await asyncio.gather(*tasks)
            if not all(done):
                raise PeerError(f"{self.name}: {done.count(False)} of {len(done)} copies of "
                                f"{key.hex()} failed")
            return
        pending: set[asyncio.Task[bool]] = set(tasks)
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.result() for t in finished):
                self._background |= pending
                for t in pending:
                    t.add_done_callback(self._background.discard)
                return
        raise PeerError(f"{self.name}: every copy of {key.hex()} failed")

    async def _write_one(self, key: bytes, block: Block, frame: EncodedFrame, member: str,
                         order: list[str], used: set[str]) -> bool:
        current: str | None = member
        while current is not None:
            target = current
            if self._is_local(target):
                result = await self._call(target, "put", lambda: self.local.put(key, block))  # type: ignore[union-attr]
            else:
                result = await self._call(target, "put", partial(
                    self.members.client(target).put, key, frame))
            if result is not _FAILED:
                return True
            current = self._next(order, used)
            if current is not None:
                used.add(current)
        return False

    async def _encode(self, block: Block) -> EncodedFrame:
        if self.compress_level is None:
            return encode_frame(block)
        return await asyncio.to_thread(encode_frame, block, compress_level=self.compress_level,
                                       shuffle=True)

    async def _delete(self, key: bytes) -> bool:
        return (await self._delete_many([key]))[0]

    # ------------------------------------------------------------------ batch
    async def _rounds(self, keys: Sequence[bytes], op: str,
                      fetch: Callable[[str, list[bytes]], Awaitable[list[Any]]],
                      found: Callable[[Any], bool]) -> list[Any]:
        """Ask owners in ring order, one request per owner per round, until each key is found
        or ``replicas`` owners answered without it. Failed owners do not count as answers."""
        await self._start()
        results: list[Any] = [None] * len(keys)
        orders = [self.members.order(k) for k in keys]
        tried: list[set[str]] = [set() for _ in keys]
        answered = [0] * len(keys)
        pending = list(range(len(keys)))
        while pending:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in pending:
                member = self._next(orders[i], tried[i]) if answered[i] < self.replicas else None
                if member is not None:
                    tried[i].add(member)
                    groups[member].append(i)
            if not groups:
                break
            calls = [self._call(m, op, partial(fetch, m, [keys[i] for i in idx]))
                     for m, idx in groups.items()]
            # One owner (every single-key call): await it directly, no task per request.
            replies = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
            pending = []
            for (_member, idx), reply in zip(groups.items(), replies, strict=True):
                if reply is _FAILED:
                    pending += idx
                    continue
                for i, value in zip(idx, cast(list[Any], reply), strict=True):
                    results[i] = value
                    if not found(value):
                        answered[i] += 1
                        pending.append(i)
        return results

    async def _fetch_blocks(self, member: str, keys: list[bytes]) -> list[Block | None]:
        if self._is_local(member):
            return await self.local.get_many(keys)  # type: ignore[union-attr]
        client = self.members.client(member)
        if len(keys) == 1:
            frames: list[bytes | memoryview | None] = [await client.get(keys[0])]
        else:
            frames = list(await client.get_many(keys))
        return [await self._decode(member, k, f) for k, f in zip(keys, frames, strict=True)]

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return await self._rounds(keys, "get", self._fetch_blocks, lambda b: b is not None)

    async def _exists(self, member: str, keys: list[bytes]) -> list[bool]:
        if self._is_local(member):
            return await self.local.contains_many(keys)  # type: ignore[union-attr]
        return await self.members.client(member).exists_many(keys)

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        got = await self._rounds(keys, "exists", self._exists, bool)
        return [bool(g) for g in got]

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        await self._start()
        frames = [await self._encode(block) for _, block in items]
        orders = [self.members.order(k) for k, _ in items]
        used = [set(self.members.live_owners(k, self.replicas)) for k, _ in items]
        wanted = [len(u) for u in used]
        stored = [0] * len(items)
        plan: dict[str, list[int]] = defaultdict(list)
        for i, owners in enumerate(used):
            for member in owners:
                plan[member].append(i)
        while plan:
            groups = list(plan.items())
            replies = await asyncio.gather(*(
                self._call(m, "put", lambda m=m, idx=idx: self._store_many(m, items, frames, idx))  # type: ignore[misc]
                for m, idx in groups))
            plan = defaultdict(list)
            for (_member, idx), reply in zip(groups, replies, strict=True):
                for i in idx:
                    if reply is not _FAILED:
                        stored[i] += 1
                        continue
                    fallback = self._next(orders[i], used[i])
                    if fallback is not None:
                        used[i].add(fallback)
                        plan[fallback].append(i)
        need = [1 if self.ack == "one" else max(w, 1) for w in wanted]
        short = sum(1 for s, n in zip(stored, need, strict=True) if s < n)
        if short:
            raise PeerError(f"{self.name}: {short} of {len(items)} blocks not stored on "
                            f"enough peers (ack={self.ack})")

    async def _store_many(self, member: str, items: Sequence[tuple[bytes, Block]],
                          frames: list[EncodedFrame], idx: list[int]) -> None:
        if self._is_local(member):
            await self.local.put_many([items[i] for i in idx])  # type: ignore[union-attr]
        elif len(idx) == 1:
            await self.members.client(member).put(items[idx[0]][0], frames[idx[0]])
        else:
            await self.members.client(member).put_many([(items[i][0], frames[i]) for i in idx])

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        # Copies may sit on fallback owners written while an owner was down: ask every member.
        await self._start()
        members = [m for m in self.members.members if self.members.alive(m)]

        async def one(member: str) -> list[bool]:
            if self._is_local(member):
                return [await self.local.delete(k) for k in keys]  # type: ignore[union-attr]
            client = self.members.client(member)
            if len(keys) == 1:
                return [await client.delete(keys[0])]
            return await client.delete_many(keys)

        replies = await asyncio.gather(*(self._call(m, "delete", lambda m=m: one(m))  # type: ignore[misc]
                                         for m in members))
        out = [False] * len(keys)
        for reply in replies:
            if isinstance(reply, list):
                out = [a or bool(b) for a, b in zip(out, reply, strict=True)]
        return out

    # ------------------------------------------------------------------ close
    async def locate(self, keys: Sequence[bytes], deadline: float
                     ) -> dict[str, LocalPrefix]:
        """Ask every other member (``POST /v1/locate``, concurrently, within ``deadline``
        seconds) how many leading ``keys`` it serves locally; late or failing members are
        left out. See :func:`kvtier.peer.locate.locate_prefix`."""
        others = [m for m in self.members.members if m != self.members.self_id]
        return await locate_prefix(others, keys, token=self._token, deadline=deadline,
                                   ssl_context=self._ssl_context)

    async def flush(self) -> None:
        """Wait for background copies of ``ack=one`` puts."""
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _aclose(self) -> None:
        try:
            await asyncio.wait_for(self.flush(), timeout=max(self.timeout * 4, 1.0))
        except TimeoutError:
            log.warning("%s: closing with %d background copies unfinished", self.name,
                        len(self._background))
            for task in list(self._background):
                task.cancel()
        await self.members.close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), **self.counts, "members": list(self.members.members),
                "dead": sorted(self.members.dead), "replicas": self.replicas,
                "member_failures": self.members.failures,
                "member_recoveries": self.members.recoveries}
