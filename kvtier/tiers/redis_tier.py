"""``redis://`` and ``redis+cluster://``: a Redis or Valkey deployment as a pool tier.

One Redis key per block (``prefix + key``) holds the block's checksummed frame, so a torn,
truncated or foreign value is a miss (and that copy is unlinked), never wrong bytes. Batch
reads are one ``MGET`` on one server and one per node in a cluster (a node that is down or
failing over costs only the keys of its slots); batch writes go out as concurrent pipelines
of at most 256 KiB (big values one ``SET`` each); ``EXISTS``/``UNLINK``/``TOUCH`` are
pipelined. The server owns capacity (its
``maxmemory-policy`` evicts); the tier reports ``used``/``capacity`` from ``INFO memory``.
Pins map onto TTLs: with ``ttl=`` set, a pinned key is ``PERSIST``-ed (immune to a
``volatile-*`` eviction policy and to expiry) and its TTL restored by the last ``unpin``.

Every call runs under one deadline (``timeout=``); connection errors, timeouts and server
errors surface as :class:`~kvtier.errors.TierError`, which the store counts as a miss (reads)
or a failed write. A server that comes back is used again without reopening the tier.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar, cast

from kvtier.codec import decode_frame, encode_frame
from kvtier.errors import ConfigError, CorruptBlockError, TierError
from kvtier.misses import MissReason
from kvtier.tiers.base import BatchTier, Block
from kvtier.urls import (
    merge_options,
    parse_bool,
    parse_number,
    parse_secret,
    parse_size,
    parse_tier_url,
)

try:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.connection import BlockingConnectionPool, Connection, SSLConnection
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import AuthenticationError, RedisError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("redis:// needs redis-py: pip install 'kvtier[redis]'") from exc

__all__ = ["RedisTier"]

log = logging.getLogger("kvtier.tiers.redis")
T = TypeVar("T")
_OPTIONS = {"prefix", "ttl", "max_connections", "token", "username", "tls", "tls_ca",
            "timeout", "name", "max_block", "usage_interval"}
_DEFAULT_PORT = 6379
_PIPELINE_BYTES = 256 << 10
# Connection errors that are the server's answer, not a missing server.
_REFUSALS = (AuthenticationError,)


def _split_host(entry: str, url: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if not sep:
        host, port = entry, str(_DEFAULT_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"url: expected host:port, got {entry!r} in {url!r}")
    return host, int(port)


class RedisTier(BatchTier):
    """A Redis (or Valkey) server or cluster as a tier shared by every store that uses it.

    Parameters
    ----------
    client
        A ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster`` client. The tier
        owns it and closes it in :meth:`aclose`. Build it with ``decode_responses=False``.
    prefix
        Prepended to every kvtier key (namespaces tenants and deployments on one server).
    ttl
        Seconds a block lives after its last write or chain touch; ``None``: no expiry.
    timeout
        Seconds allowed for one call (a batch included); slower is a failure, counted.
    max_block
        Largest frame written, in bytes (keep it under the server's ``proto-max-bulk-len``).
    usage_interval
        Seconds between ``INFO memory`` refreshes behind :attr:`used`/:attr:`capacity`.

    Notes
    -----
    Pins are counted per tier object: another process's ``unpin`` does not release them,
    and a ``PERSIST``-ed key only resists eviction under a ``volatile-*`` policy.

    Examples
    --------
    ``redis://127.0.0.1:6379/0?prefix=kvt:&ttl=3600&token=env:REDIS_PASSWORD``
    ``redis+cluster://h1:7000,h2:7001?timeout=2``
    """

    scheme = "redis"
    shared = True  # other stores of the pool read it: private tiers above write through

    def __init__(self, client: Redis | RedisCluster, *, prefix: str = "kvt:",
                 ttl: int | None = None, timeout: float = 1.0, max_block: int = 512 << 20,
                 usage_interval: float = 5.0, name: str | None = None) -> None:
        cluster = isinstance(client, RedisCluster)
        super().__init__(name=name or ("redis+cluster" if cluster else "redis"))
        if ttl is not None and ttl < 1:
            raise ConfigError(f"ttl: expected >= 1 second or None, got {ttl!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout!r}")
        self.client = client
        self.cluster = cluster
        self.prefix = prefix.encode()
        self.ttl = ttl
        self.timeout = timeout
        self.max_block = max_block
        self.usage_interval = usage_interval
        self.counts: Counter[str] = Counter()
        self._pins: Counter[bytes] = Counter()
        self._used = 0
        self._capacity: int | None = None
        self._usage_at = -usage_interval
        self._usage_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ config
    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``redis://host:port/db?...`` or ``redis+cluster://h1:p1,h2:p2?...``.

        Options: ``prefix``, ``ttl`` (seconds, 0 = none), ``max_connections``, ``token``
        (password; ``env:VAR``/``file:PATH``), ``username``, ``tls`` (1/0), ``tls_ca``,
        ``timeout`` (seconds), ``max_block`` (size), ``usage_interval``, ``name``.
        """
        parsed = parse_tier_url(url)
        if parsed.scheme not in ("redis", "redis+cluster"):
            raise ConfigError(f"url: expected redis:// or redis+cluster://, got {url!r}")
        if "@" in parsed.netloc:
            raise ConfigError("url: put credentials in token=env:NAME, not in the URL")
        opts = merge_options(parsed, options, _OPTIONS)
        entries = [e.strip() for e in parsed.netloc.split(",") if e.strip()]
        if not entries:
            raise ConfigError(f"url: no host in {parsed.scheme}:// URL")
        nodes = [_split_host(e, parsed.scheme + "://" + parsed.netloc) for e in entries]
        db_text = parsed.path.strip("/")
        if parsed.scheme == "redis+cluster":
            if db_text not in ("", "0"):
                raise ConfigError(f"url: redis+cluster:// has only database 0, got /{db_text}")
        elif len(nodes) != 1:
            raise ConfigError("url: redis:// takes one host:port (use redis+cluster:// for "
                              "several)")
        elif db_text and not db_text.isdigit():
            raise ConfigError(f"url: database must be a number, got /{db_text}")
        timeout = parse_number(opts.get("timeout", 1.0), "timeout", float, 0.001)
        token = opts.get("token")
        password = None if token in (None, "") else parse_secret(str(token), "token")
        tls = parse_bool(opts.get("tls", False), "tls")  # type: ignore[arg-type]
        ssl_ca = str(opts["tls_ca"]) if opts.get("tls_ca") else None
        if ssl_ca and not tls:
            raise ConfigError("tls_ca: given without tls=1")
        tier_opts: dict[str, Any] = dict(  # all checked before a client exists
            prefix=str(opts.get("prefix", "kvt:")),
            ttl=parse_number(opts.get("ttl", 0), "ttl", int, 0) or None,
            max_block=parse_size(opts.get("max_block", 512 << 20), "max_block"),  # type: ignore[arg-type]
            usage_interval=parse_number(opts.get("usage_interval", 5.0), "usage_interval",
                                        float, 0.0),
            name=str(opts["name"]) if opts.get("name") else None)
        common: dict[str, Any] = dict(
            password=password, username=str(opts["username"]) if opts.get("username") else None,
            socket_timeout=timeout, socket_connect_timeout=timeout,
            max_connections=parse_number(opts.get("max_connections", 64), "max_connections",
                                         int, 1),
            # One immediate retry absorbs a pooled connection that died with a restarted
            # server; more retries (with backoff) would only delay the miss.
            retry=Retry(NoBackoff(), 1), decode_responses=False)
        client: Redis | RedisCluster
        if parsed.scheme == "redis+cluster":
            if tls:
                common.update(ssl=True, ssl_cert_reqs=ssl.CERT_REQUIRED, ssl_ca_certs=ssl_ca)
            client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                                  require_full_coverage=False, **common)
        else:
            # A blocking pool makes a call beyond max_connections wait for a connection
            # (within timeout) instead of failing at once.
            max_connections = common.pop("max_connections")
            del common["decode_responses"]
            if tls:
                common.update(ssl_cert_reqs=ssl.CERT_REQUIRED, ssl_ca_certs=ssl_ca)
            client = Redis.from_pool(BlockingConnectionPool(
                connection_class=SSLConnection if tls else Connection,
                max_connections=max_connections, timeout=timeout, host=nodes[0][0],
                port=nodes[0][1], db=int(db_text or 0), **common))
        return cls(client, timeout=timeout, **tier_opts)

    async def open(self) -> None:
        """``SET`` and ``DEL`` a probe key with the tier's credentials (``open_store`` calls
        this), so a wrong password, a user without write access or a read-only replica fails
        at open instead of turning every get into a miss.

        Raises
        ------
        ConfigError
            When the server answers with an error (authentication, ACL, ``READONLY``,
            ``OOM``...). A server that cannot be reached is only logged: stores and servers
            start in any order, and the tier uses the server once it answers.
        """
        probe = self.prefix + b"kvtier-probe:" + os.urandom(8).hex().encode()

        async def set_and_delete() -> None:
            await self.client.set(probe, b"1", ex=60)
            await self.client.delete(probe)

        try:
            await self._run("probe", set_and_delete)
        except TierError as exc:
            cause = exc.__cause__
            if isinstance(cause, RedisConnectionError | RedisTimeoutError | OSError |
                          TimeoutError) and not isinstance(cause, _REFUSALS):
                log.warning("%s: server unreachable at open (%s); it is used once it answers",
                            self.name, cause)
                return
            raise ConfigError(
                f"{self.name}: the server refused a probe write ({type(cause).__name__}: "
                f"{cause}); check token= and username= (the server's requirepass/ACL user "
                "needs SET and DEL on keys under prefix=) and that it is a writable primary"
            ) from exc

    # ----------------------------------------------------------------- usage
    @property
    def capacity(self) -> int | None:
        """The servers' ``maxmemory`` summed over primaries (``None``: unset or not read yet)."""
        return self._capacity

    @property
    def used(self) -> int:
        """``used_memory`` summed over primaries, from the last ``INFO memory`` refresh."""
        return self._used

    def _maybe_refresh_usage(self) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() - self._usage_at < self.usage_interval or self._usage_task is not None:
            return
        self._usage_at = loop.time()
        self._usage_task = loop.create_task(self.refresh_usage())
        self._usage_task.add_done_callback(self._usage_done)

    def _usage_done(self, task: asyncio.Task[None]) -> None:
        self._usage_task = None
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: INFO memory failed: %s", self.name, task.exception())

    async def refresh_usage(self) -> None:
        """Read ``INFO memory`` now (``used``/``capacity`` otherwise refresh in the background
        every ``usage_interval`` seconds while the tier is used)."""
        if self.cluster:
            reply = await self._run("info", lambda: self.client.info(
                "memory", target_nodes=RedisCluster.PRIMARIES))
            infos = list(reply.values()) if isinstance(reply, dict) and \
                "used_memory" not in reply else [reply]
        else:
            infos = [await self._run("info", lambda: self.client.info("memory"))]
        self._used = sum(int(i.get("used_memory", 0)) for i in infos)
        limits = [int(i.get("maxmemory", 0)) for i in infos]
        self._capacity = sum(limits) if limits and all(limits) else None

    # ----------------------------------------------------------------- plumbing
    def _rkey(self, key: bytes) -> bytes:
        return self.prefix + key

    async def _run(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """One server call under the tier's deadline; failures become :class:`TierError`."""
        self.counts[f"{op}_requests"] += 1
        try:
            async with asyncio.timeout(self.timeout):
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            self.counts["errors"] += 1
            raise TierError(f"{self.name}: {op} failed: {type(exc).__name__}: {exc}") from exc

    def _decode(self, key: bytes, value: bytes | None) -> Block | None:
        if value is None:
            return None
        try:
            return decode_frame(value, key=key)
        except CorruptBlockError as exc:
            self.counts["corrupt"] += 1
            log.warning("%s: dropping corrupt value of %s: %s", self.name, key.hex(), exc)
            self._report_miss((key,), MissReason.CORRUPT, str(exc))
            return None

    async def _drop_corrupt(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        try:
            await self._run("unlink", lambda: self._pipelined("UNLINK", keys))
        except TierError as exc:  # the read already counts as a miss
            log.debug("%s", exc)

    async def _pipelined(self, command: str, keys: Sequence[bytes],
                         *args: int) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            # execute_command queues in both modes (the cluster pipeline's named multi-key
            # helpers such as ``unlink`` are coroutines instead).
            pipe.execute_command(command, self._rkey(key), *args)
        return list(await pipe.execute())

    def _frame(self, key: bytes, block: Block) -> bytes:
        frame = encode_frame(block, key=key)
        if frame.nbytes > self.max_block:
            raise TierError(f"{self.name}: block {key.hex()} is {frame.nbytes} bytes, over "
                            f"max_block={self.max_block}")
        return frame.to_bytes()

    # ----------------------------------------------------------------- contract
    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        self._maybe_refresh_usage()
        if self.cluster and len(keys) > 1:
            values = await self._cluster_mget(keys)
        else:
            values = await self._run("get", lambda: self._mget(keys))
        blocks = [self._decode(k, v) for k, v in zip(keys, values, strict=True)]
        await self._drop_corrupt([k for k, v, b in zip(keys, values, blocks, strict=True)
                                  if v is not None and b is None])
        return blocks

    async def _mget(self, keys: Sequence[bytes]) -> list[bytes | None]:
        rkeys = [self._rkey(k) for k in keys]
        if self.cluster:
            return list(await self.client.mget_nonatomic(rkeys))  # type: ignore[union-attr]
        return cast(list[bytes | None], await self.client.mget(rkeys))

    async def _cluster_mget(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Per-node ``MGET``s in parallel: a node that is down costs only its own keys."""
        await self._run("init", self._initialized)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            node = self.client.get_node_from_key(self._rkey(key))  # type: ignore[union-attr, arg-type]
            groups[node.name if node is not None else ""].append(i)

        failed: list[TierError] = []

        async def fetch(idx: list[int]) -> list[bytes | None]:
            try:
                return await self._run("get", lambda: self._mget([keys[i] for i in idx]))
            except TierError as exc:
                failed.append(exc)
                return [None] * len(idx)

        replies = await asyncio.gather(*(fetch(idx) for idx in groups.values()))
        if len(failed) == len(groups):
            raise failed[0]  # nothing answered: the store counts one error
        for exc in failed:
            log.debug("%s", exc)
        out: list[bytes | None] = [None] * len(keys)
        for idx, values in zip(groups.values(), replies, strict=True):
            for i, value in zip(idx, values, strict=True):
                out[i] = value
        return out

    async def _initialized(self) -> None:
        await self.client.initialize()

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        found = await self._run("exists", lambda: self._pipelined("EXISTS", keys))
        return [bool(f) for f in found]

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        self._maybe_refresh_usage()
        # One write per key (the last value wins), since chunks below run concurrently.
        frames = [(key, self._frame(key, block)) for key, block in dict(items).items()]
        # Pipelines of at most ~_PIPELINE_BYTES, sent concurrently: a server parsing one
        # pipeline of big values moves its query buffer after every command (16 SETs of
        # 1 MiB: 90-100 ms pipelined vs 10-25 ms one by one here), while small values gain
        # from pipelining (64 of 16 KiB: 2-7 ms vs 6-19 ms).
        chunks: list[list[tuple[bytes, bytes]]] = [[]]
        size = 0
        for key, frame in frames:
            if chunks[-1] and size + len(frame) > _PIPELINE_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append((key, frame))
            size += len(frame)

        async def write(chunk: list[tuple[bytes, bytes]]) -> None:
            if len(chunk) == 1:
                key, frame = chunk[0]
                await self.client.set(self._rkey(key), frame, ex=self._ttl_for(key))
                return
            pipe = self.client.pipeline(transaction=False)
            for key, frame in chunk:
                pipe.set(self._rkey(key), frame, ex=self._ttl_for(key))
            await pipe.execute()

        await self._run("put", lambda: self._bounded(write, chunks))

    def _ttl_for(self, key: bytes) -> int | None:
        # A pinned key keeps no TTL; others get the tier's TTL (or none).
        return None if self._pins[key] else self.ttl

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        removed = await self._run("delete", lambda: self._pipelined("UNLINK", keys))
        return [bool(r) for r in removed]

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        # Tail first, so the head ends up the most recently used (Redis LRU samples idle time).
        tail_first = list(reversed(keys))
        await self._run("touch", lambda: self._pipelined("TOUCH", tail_first))
        ttl = self.ttl
        unpinned = [k for k in tail_first if not self._pins[k]]
        if ttl is not None and unpinned:
            await self._run("expire", lambda: self._pipelined("EXPIRE", unpinned, ttl))

    async def _pin(self, keys: Sequence[bytes]) -> None:
        first = [k for k in dict.fromkeys(keys) if not self._pins[k]]
        for key in keys:
            self._pins[key] += 1
        if self.ttl is not None and first:
            await self._run("pin", lambda: self._pipelined("PERSIST", first))

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        released = []
        for key in keys:
            if self._pins[key] <= 0:
                continue
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                released.append(key)
        ttl = self.ttl
        if ttl is not None and released:
            await self._run("unpin", lambda: self._pipelined("EXPIRE", released, ttl))

    async def _aclose(self) -> None:
        if self._usage_task is not None:
            self._usage_task.cancel()
            await asyncio.gather(self._usage_task, return_exceptions=True)
        await self.client.aclose()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), **self.counts, "ttl": self.ttl,
                "pinned": len(self._pins), "cluster": self.cluster}
