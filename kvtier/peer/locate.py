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

Registration on a :class:`~kvtier.peer.server.PeerServer` (before ``start``)::

    server.app.router.add_post(LOCATE_PATH, make_locate_handler(
        tiers_answer(local_tiers(server.segment.tiers)), node=server.node_id or "",
        limits=server.limits))
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from kvtier.events import MEDIUM_SHARED, medium_of
from kvtier.peer import protocol as proto

__all__ = ["LOCATE_PATH", "LocalPrefix", "LocateAnswer", "decode_answer", "encode_answer",
           "local_tiers", "locate_prefix", "make_locate_handler", "tiers_answer"]

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


class _LocalTier(Protocol):
    name: str

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...


def local_tiers(tiers: Sequence[Any]) -> list[Any]:
    """The tiers a node serves without a network fetch: every tier whose event medium is not
    ``shared_storage`` (a ``peers://`` pool, ``redis://``, ``s3://``, ... are left out)."""
    return [t for t in tiers if medium_of(t) != MEDIUM_SHARED]


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


def make_locate_handler(answer: LocateAnswer, *, node: str,
                        limits: proto.Limits | None = None
                        ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler for ``POST /v1/locate`` answering with ``answer``.

    Authentication is the application's (a ``PeerServer``'s middleware); the handler bounds
    the body (``413``) and refuses malformed key lists (``400``) before calling ``answer``.
    """
    lim = limits or proto.Limits()
    max_body = min(4 + lim.max_batch * (2 + 128), lim.max_body_bytes)

    async def handle(request: web.Request) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > max_body:
            raise web.HTTPRequestEntityTooLarge(max_size=max_body, actual_size=length,
                                                text=f"body of {length} bytes exceeds "
                                                     f"{max_body}")
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.read(1 << 16):  # b"" at the end of the body
            size += len(chunk)
            if size > max_body:
                raise web.HTTPRequestEntityTooLarge(max_size=max_body, actual_size=size,
                                                    text=f"body exceeds {max_body} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            keys = proto.decode_keys(body, lim.max_batch)
        except proto.LimitExceededError as exc:
            raise web.HTTPRequestEntityTooLarge(max_size=max_body, actual_size=len(body),
                                                text=str(exc)) from None
        except proto.ProtocolError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        prefix = await answer(keys) if keys else LocalPrefix(0)
        return web.Response(body=encode_answer(node, prefix), content_type="application/json")

    return handle


async def _ask(session: aiohttp.ClientSession, base: str, body: bytes, headers: dict[str, str],
               n_keys: int) -> LocalPrefix:
    async with session.post(f"{base}{LOCATE_PATH}", data=body, headers=headers) as resp:
        if resp.status != 200:
            raise proto.ProtocolError(f"locate: HTTP {resp.status}")
        return decode_answer(await resp.read(), n_keys)[1]


async def locate_prefix(members: Sequence[str], keys: Sequence[bytes], *, token: str | None,
                        deadline: float = 0.05, session: aiohttp.ClientSession | None = None,
                        scheme: str = "http") -> dict[str, LocalPrefix]:
    """Ask every member (``host:port``) how many leading ``keys`` it holds locally.

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
    sess = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=deadline))
    start = time.monotonic()
    try:
        tasks = {asyncio.ensure_future(_ask(sess, f"{scheme}://{m}", body, headers,
                                            len(key_list))): m for m in members}
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
            log.debug("locate: %s left out: no answer within %.3f s", tasks[task],
                      time.monotonic() - start)
        return out
    finally:
        if own:
            await sess.close()
