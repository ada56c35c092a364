"""``POST /v1/locate``: how many leading blocks of a prefix a node can serve locally.

A KV-aware router asks every pool member, concurrently and under one deadline, how long a run
of a prompt's leading keys it holds *in its own tiers* (DRAM, its pool segment, local disk:
anything served without a network fetch), then routes to the longest (ties by load).

Wire format (documented in ``docs/peer-protocol.md``):

- request: ``POST /v1/locate``, bearer token as for every peer request, body a key list as in
  the batch requests (``u32 count``, then ``count x (u16 key_len, key)``, little-endian),
  the prompt's keys in prefix order; at most ``Limits.max_batch`` keys.
- response: ``200``, JSON ``{"node": str, "blocks": int, "tier": str | null,
  "by_tier": {tier name: blocks}}``: ``blocks`` leading keys are held locally, ``by_tier``
  counts where each of them is first found (top tier first), and ``tier`` is the slowest
  tier the run reaches (``null`` when ``blocks`` is 0).
- errors: ``400`` malformed body, ``413`` more keys or bytes than the limits, ``401`` without
  the token (the server's auth), nothing else changes state: locating never refreshes
  recency and never pins.

A :class:`~kvtier.peer.server.PeerServer` registers the route for its segment with
``make_locate_handler(segment_answer(segment), node=..., limits=...)``;
:meth:`kvtier.TieredStore.locate_prefix` asks the members through :func:`locate_prefix` and
answers for its own private tiers with :func:`locate_in_pool`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from kvtier.events import MEDIUM_SHARED, medium_of
from kvtier.peer import protocol as proto

__all__ = ["LOCATE_PATH", "BodyReader", "LocalPrefix", "LocateAnswer", "PrefixLocation",
           "decode_answer", "encode_answer", "local_tiers", "locate_in_pool", "locate_prefix",
           "make_locate_handler", "read_bounded", "segment_answer", "segment_tiers",
           "tiers_answer"]

log = logging.getLogger(__name__)

LOCATE_PATH = f"{proto.API_PREFIX}/locate"


@dataclass(frozen=True)
class LocalPrefix:
    """What one node holds of a prefix, locally.

    Attributes
    ----------
    blocks
        Leading keys the node serves without a network fetch.
    tier
        The slowest of its tiers the run reaches (``None`` when ``blocks`` is 0).
    by_tier
        Per tier name, how many of those blocks are first found there.
    """

    blocks: int
    tier: str | None = None
    by_tier: Mapping[str, int] = field(default_factory=dict)


LocateAnswer = Callable[[list[bytes]], Awaitable[LocalPrefix]]


@dataclass(frozen=True)
class PrefixLocation:
    """What :meth:`kvtier.TieredStore.locate_prefix` returns: where a prefix's leading blocks
    can be served from.

    Attributes
    ----------
    node
        The asking process's node id (its entry in ``nodes``).
    nodes
        ``{node id: LocalPrefix}``: for this process (its private tiers, and its own pool
        segment when it serves one) and for every pool member that answered within the
        deadline (members are named by their ``host:port``), how many leading blocks it
        serves *without a network fetch* and from which tier. A member that did not answer
        in time is absent, not zero.
    pool
        Leading blocks readable through the asking store at all (its private tiers and its
        shared tiers, a fetch from the pool included); ``pool >= nodes[node].blocks``.
    """

    node: str
    nodes: Mapping[str, LocalPrefix]
    pool: int

    def best(self) -> str | None:
        """The node with the longest local run (``None`` if no node holds the first block);
        ties go to the first answer in ``nodes`` (this process first)."""
        node = max(self.nodes, key=lambda n: self.nodes[n].blocks, default=None)
        return node if node is not None and self.nodes[node].blocks else None


class _LocalTier(Protocol):
    name: str

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...


def local_tiers(tiers: Sequence[Any]) -> list[Any]:
    """The tiers a node serves without a network fetch: every tier whose event medium is not
    ``shared_storage`` (a ``peers://`` pool, ``redis://``, ``s3://``, ... are left out)."""
    return [t for t in tiers if medium_of(t) != MEDIUM_SHARED]


def segment_tiers(segment: object) -> list[Any]:
    """The tiers of a served segment: a store's ``tiers``, or the segment itself (a tier)."""
    tiers = getattr(segment, "tiers", None)
    return list(tiers) if isinstance(tiers, list) else [segment]


def segment_answer(segment: object) -> LocateAnswer:
    """The ``/v1/locate`` answer of a :class:`~kvtier.peer.server.PeerServer`'s segment: its
    local (not ``shared_storage``) tiers, top first."""
    return tiers_answer(local_tiers(segment_tiers(segment)))


def tiers_answer(tiers: Sequence[_LocalTier]) -> LocateAnswer:
    """An answer callable over ``tiers`` (top first): one ``contains_many`` per tier for the
    keys not yet found, stopping at the first key no tier holds. ``contains_many`` never
    refreshes recency, so locating leaves eviction order alone."""
    tier_list = list(tiers)

    async def answer(keys: list[bytes]) -> LocalPrefix:
        found: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for level, tier in enumerate(tier_list):
            if not todo:
                break
            present = await tier.contains_many([keys[i] for i in todo])
            todo_next = []
            for i, here in zip(todo, present, strict=True):
                if here:
                    found[i] = level
                else:
                    todo_next.append(i)
            todo = todo_next
        run = next((i for i, level in enumerate(found) if level is None), len(keys))
        by_tier: dict[str, int] = {}
        deepest = -1
        for where in found[:run]:
            if where is None:  # pragma: no cover - run stops before the first None
                break
            name = tier_list[where].name
            by_tier[name] = by_tier.get(name, 0) + 1
            deepest = max(deepest, where)
        return LocalPrefix(run, tier_list[deepest].name if deepest >= 0 else None, by_tier)

    return answer


def encode_answer(node: str, prefix: LocalPrefix) -> bytes:
    """The JSON response body."""
    return json.dumps({"node": node, "blocks": prefix.blocks, "tier": prefix.tier,
                       "by_tier": dict(prefix.by_tier)}).encode()


def decode_answer(body: bytes, max_blocks: int) -> tuple[str, LocalPrefix]:
    """Parse a response body; raises :class:`~kvtier.peer.protocol.ProtocolError` when it is
    not one (a member cannot claim more blocks than were asked about)."""
    try:
        doc = json.loads(body)
        node, blocks, tier, by_tier = doc["node"], doc["blocks"], doc["tier"], doc["by_tier"]
    except (ValueError, TypeError, KeyError) as exc:
        raise proto.ProtocolError(f"locate: malformed answer ({exc})") from None
    if (not isinstance(node, str) or type(blocks) is not int or not 0 <= blocks <= max_blocks
            or not (tier is None or isinstance(tier, str)) or not isinstance(by_tier, dict)
            or not all(isinstance(k, str) and type(v) is int and v >= 0
                       for k, v in by_tier.items())
            or sum(by_tier.values()) != blocks):
        raise proto.ProtocolError(f"locate: inconsistent answer {doc!r:.200}")
    return node, LocalPrefix(blocks, tier, by_tier)


BodyReader = Callable[[web.Request, int], Awaitable[bytes | memoryview]]


async def read_bounded(request: web.Request, limit: int) -> bytes:
    """A request body of at most ``limit`` bytes (``413`` past it): the reader of a
    ``/v1/locate`` handler mounted outside a :class:`~kvtier.peer.server.PeerServer`."""
    length = request.content_length
    if length is not None and length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length,
                                            text=f"body of {length} bytes exceeds {limit}")
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(1 << 16):  # b"" at the end of the body
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size,
                                                text=f"body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def make_locate_handler(answer: LocateAnswer, *, node: str | Callable[[], str],
                        limits: proto.Limits | None = None,
                        read_body: BodyReader = read_bounded,
                        ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler for ``POST /v1/locate`` answering with ``answer``; ``node`` (or a
    callable returning it, read per request) names the node in the answers.

    Authentication is the application's (a ``PeerServer``'s middleware); the handler reads
    the body with ``read_body(request, limit)`` (a ``PeerServer`` passes its own guarded
    read: body timeout ``408``, in-flight budget ``503``; the default only bounds the size,
    ``413``) and refuses malformed key lists (``400``) before calling ``answer``.
    """
    lim = limits or proto.Limits()
    max_body = min(4 + lim.max_batch * (2 + 128), lim.max_body_bytes)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, max_body)
        try:
            keys = proto.decode_keys(body, lim.max_batch)
        except proto.LimitExceededError as exc:
            raise web.HTTPRequestEntityTooLarge(max_size=max_body, actual_size=len(body),
                                                text=str(exc)) from None
        except proto.ProtocolError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        prefix = await answer(keys) if keys else LocalPrefix(0)
        name = node() if callable(node) else node
        return web.Response(body=encode_answer(name, prefix), content_type="application/json")

    return handle


async def _ask(session: aiohttp.ClientSession, base: str, body: bytes, headers: dict[str, str],
               n_keys: int, server_hostname: str | None) -> LocalPrefix:
    async with session.post(f"{base}{LOCATE_PATH}", data=body, headers=headers,
                            server_hostname=server_hostname) as resp:
        if resp.status != 200:
            raise proto.ProtocolError(f"locate: HTTP {resp.status}")
        return decode_answer(await resp.read(), n_keys)[1]


async def locate_prefix(members: Sequence[str], keys: Sequence[bytes], *, token: str | None,
                        deadline: float = 0.05, session: aiohttp.ClientSession | None = None,
                        scheme: str | None = None, ssl_context: ssl.SSLContext | None = None,
                        tls_server_name: str | None = None) -> dict[str, LocalPrefix]:
    """Ask every member (``host:port``) how many leading ``keys`` it holds locally.

    ``scheme`` defaults to ``https`` with an ``ssl_context`` (the pool's client TLS context),
    else ``http``. ``tls_server_name``, with TLS, is the name every member's certificate is
    verified against (and sent as SNI) instead of its host, as in the pool's
    ``tls_server_name=`` option.

    One request per member, all concurrent; a member that has not answered within
    ``deadline`` seconds, or answers with an error, is left out of the result (logged at
    debug level), never waited for. ``keys`` beyond :class:`Limits`'s ``max_batch`` are not
    sent: a run longer than that is reported as ``max_batch``.

    Returns
    -------
    dict
        ``{member: LocalPrefix}`` for the members that answered in time.
    """
    if not isinstance(deadline, (int, float)) or not deadline > 0:
        raise ValueError(f"deadline: expected seconds > 0, got {deadline!r}")
    key_list = list(keys)[: proto.Limits().max_batch]
    for key in key_list:
        if not isinstance(key, bytes) or not 1 <= len(key) <= 128:
            raise TypeError(f"keys: expected bytes of 1..128 bytes, got {key!r:.60}")
    if not members:
        return {}
    body = proto.encode_keys(key_list)
    headers = {"Content-Type": proto.CONTENT_TYPE}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    own = session is None
    if scheme is None:
        scheme = "https" if ssl_context is not None else "http"
    sess = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=deadline),
        connector=aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else False))
    start = time.monotonic()
    try:
        hostname = tls_server_name if scheme == "https" else None
        tasks = {asyncio.ensure_future(_ask(sess, f"{scheme}://{m}", body, headers,
                                            len(key_list), hostname)): m for m in members}
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        out: dict[str, LocalPrefix] = {}
        for task in done:
            member = tasks[task]
            exc = task.exception()
            if exc is None:
                out[member] = task.result()
            else:
                log.debug("locate: %s left out: %r", member, exc)
        for task in pending:
            if not task.cancelled():
                task.exception()  # ended by the session's own timeout meanwhile: retrieved
            log.debug("locate: %s left out: no answer within %.3f s", tasks[task],
                      time.monotonic() - start)
        return out
    finally:
        if own:
            await sess.close()


class _PoolTier(Protocol):
    local: Any

    async def locate(self, keys: Sequence[bytes], deadline: float | None
                     ) -> dict[str, LocalPrefix]: ...


async def locate_in_pool(node: str, tiers: Sequence[Any], keys: list[bytes],
                         deadline: float | None, pool_count: Awaitable[int]) -> PrefixLocation:
    """Locate ``keys`` for a store whose chain is ``tiers``: its own answer (its local tiers,
    plus the segment it serves to the pool), every member of its pool tiers (``locate``),
    and ``pool_count`` (the store's leading run over all its tiers), concurrently, within
    ``deadline`` seconds (``None``: no limit but each pool tier's own). Anything late is left
    out (``pool`` then counts 0)."""
    own: list[Any] = local_tiers(tiers)
    pools: list[_PoolTier] = [t for t in tiers if callable(getattr(t, "locate", None))]
    for pool_tier in pools:
        if pool_tier.local is not None:
            own += [t for t in local_tiers(segment_tiers(pool_tier.local))
                    if all(t is not o for o in own)]

    async def bounded(aw: Awaitable[Any]) -> Any:
        async with asyncio.timeout(deadline):
            return await aw

    results = await asyncio.gather(
        bounded(tiers_answer(own)(keys)), bounded(pool_count),
        *(pool_tier.locate(keys, deadline) for pool_tier in pools), return_exceptions=True)
    mine, pool, *remote = results
    nodes: dict[str, LocalPrefix] = {}
    if isinstance(mine, LocalPrefix):
        nodes[node] = mine
    else:
        log.debug("locate: this node's own answer left out: %r", mine)
    for answer in remote:
        if isinstance(answer, dict):
            for member, prefix in answer.items():
                nodes.setdefault(member, prefix)
        else:
            log.debug("locate: a pool tier failed: %r", answer)
    return PrefixLocation(node, nodes, pool if isinstance(pool, int) else 0)
