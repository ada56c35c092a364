"""``local://NAME``: the host daemon (``kvtier serve --shm NAME``) as a tier of an engine.

Presence questions are answered from the daemon's presence index, a table in shared memory
this process maps read-only (:mod:`kvtier.shm.index`): no call on the socket. A hit is lent
as slots of the daemon's shared arena (a lease each); this process copies each block
**once**, from its mapping of the arena straight into the caller's buffer
(``get_many_into``), then releases the leases, and trusts the copy only if the daemon says
every lease was still valid (never expired, so the slot was never reused under it). A save
asks for fresh slots (prepare), copies each block once into them, and commits: the daemon
keeps the blocks where they were copied. See ``docs/host-daemon.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any, Self

import numpy as np

from kvtier.errors import BlockTooLargeError, ConfigError, ProtocolError, TierError, TierFullError
from kvtier.shm import protocol as p
from kvtier.shm.client import LocalClient
from kvtier.shm.files import validate_name
from kvtier.tiers.base import Block, Tier, check_output_spec, copy_into
from kvtier.urls import merge_options, parse_number, parse_tier_url

__all__ = ["LocalTier", "local_key", "parse_local_url"]

log = logging.getLogger("kvtier.local")
_OPTIONS = {"timeout", "namespace", "name"}


def parse_local_url(url: str, **options: Any) -> dict[str, Any]:
    """``local://NAME?...`` as :class:`LocalTier`'s arguments (``daemon``, ``timeout``,
    ``namespace``, ``name``).

    Raises
    ------
    ConfigError
        For a path, an unknown option, a bad name or timeout.
    """
    parsed = parse_tier_url(url)
    if parsed.scheme != "local" or parsed.path not in ("", "/"):
        raise ConfigError(f"url: expected local://NAME with no path, got {url!r}")
    opts = merge_options(parsed, options, _OPTIONS)
    namespace = opts.get("namespace")
    return {"daemon": validate_name(parsed.netloc, "url"),
            "timeout": parse_number(opts.get("timeout", 1.0), "timeout", float, 0.001),
            "namespace": None if namespace in (None, "") else str(namespace),
            "name": str(opts["name"]) if opts.get("name") else None}


def local_key(namespace: str | None, key: bytes) -> bytes:
    """The key the daemon stores ``key`` under for a tier of ``namespace``."""
    if namespace is None:
        return key
    return hashlib.blake2b(namespace.encode() + b"\0" + key, digest_size=16).digest()


class LocalTier(Tier):
    """The host daemon called ``daemon``, attached from this process.

    Parameters
    ----------
    daemon
        The daemon's ``--shm`` name.
    timeout
        Seconds one call to the daemon may take; a slower daemon (stopped, overloaded) is a
        :class:`~kvtier.errors.TierError`, which a store counts as a miss.
    namespace
        Keeps this tier's keys apart from other users of the daemon: each key is stored as
        a 16-byte digest of the namespace and the key.
    name
        Label in stats.

    Notes
    -----
    The tier holds no blocks itself: ``capacity`` and ``used`` are the daemon's DRAM
    tier's (``used`` as of the last answer), and the daemon evicts (and demotes down its
    own chain) by its own budget, so ``on_evict`` is never called here.

    Examples
    --------
    ``local://kv0?timeout=0.5&namespace=llama-8b``
    """

    scheme = "local"
    shared = True  # other engines on the host read it

    def __init__(self, daemon: str, *, timeout: float = 1.0, namespace: str | None = None,
                 name: str | None = None) -> None:
        super().__init__(name=name or f"local://{daemon}")
        validate_name(daemon, "url")
        if not timeout > 0:
            raise ConfigError(f"timeout: expected > 0, got {timeout!r}")
        self.daemon = daemon
        self.timeout = timeout
        self.namespace = namespace
        self._client = LocalClient(daemon, timeout=timeout)
        self.counts: Counter[str] = Counter()
        self._background: set[asyncio.Task[Any]] = set()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``local://NAME[?timeout=SECONDS][&namespace=TEXT][&name=LABEL]``."""
        args = parse_local_url(url, **options)
        return cls(args.pop("daemon"), **args)

    async def open(self) -> None:
        """Map the daemon's arena now if it is up (a daemon that starts later is attached
        on first use; until then every read is a miss)."""
        try:
            await self._client.attach()
        except TierError as exc:
            log.warning("%s: not attached yet: %s", self.name, exc)

    @property
    def capacity(self) -> int | None:
        info = self._client.info
        return None if info is None else info.get("capacity")

    @property
    def used(self) -> int:
        return self._client.used

    # ------------------------------------------------------------------ keys
    def _k(self, key: bytes) -> bytes:
        return local_key(self.namespace, key)

    def _hex(self, keys: Sequence[bytes]) -> list[str]:
        return [self._k(k).hex() for k in keys]

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` (a release or abort after a cancelled call) in the background."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quiet(self, path: str, msg: dict[str, Any]) -> None:
        with contextlib.suppress(TierError):  # else the lease ends at its time bound
            await self._client.call(path, msg)

    # ------------------------------------------------------------------ reads
    async def _lease(self, keys: Sequence[bytes]) -> list[dict[str, Any] | None]:
        """Slots of ``keys`` lent by the daemon (``None``: a miss), in this mapping."""
        if self._client.info is None:
            await self._client.attach()
        answer = await self._client.call("/v1/lease", {"keys": self._hex(keys)})
        slots = answer.get("slots")
        if not isinstance(slots, list) or len(slots) != len(keys):
            raise TierError(f"{self.name}: malformed lease answer")
        ids = [s["lease"] for s in slots if s is not None]
        try:
            readable = await self._client.ensure(answer.get("instance"))
        except BaseException:
            self._spawn(self._quiet("/v1/release", {"leases": ids}))
            raise
        if not readable:
            raise TierError(f"{self.name}: the daemon restarted during the call")
        for key, slot in zip(keys, slots, strict=True):
            if slot is not None and slot.get("key") != self._k(key).hex():
                self._spawn(self._quiet("/v1/release", {"leases": ids}))
                raise TierError(f"{self.name}: the daemon lent a slot of another key")
        self.counts["leased"] += len(ids)
        return slots

    def _view(self, slot: dict[str, Any]) -> Block:
        """The leased block in this process's mapping of the arena (read it, never keep it)."""
        buffer = self._client.buffer
        try:
            dtype, shape = p.parse_dtype(slot["dtype"]), p.parse_shape(slot["shape"])
            offset, nbytes = int(slot["offset"]), int(slot["nbytes"])
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            raise TierError(f"{self.name}: malformed slot: {exc}") from None
        if buffer is None or not 0 <= offset <= buffer.nbytes - nbytes or \
                nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise TierError(f"{self.name}: slot outside the arena")
        return np.ndarray(shape, dtype, buffer, offset)

    async def _finish(self, slots: Sequence[dict[str, Any] | None]) -> list[bool]:
        """Release the leases after the copies; which copies are good."""
        ids = [s["lease"] for s in slots if s is not None]
        if not ids:
            return [False] * len(slots)
        try:
            answer = await self._client.call("/v1/release", {"leases": ids})
        except asyncio.CancelledError:
            self._spawn(self._quiet("/v1/release", {"leases": ids}))
            raise
        valid = iter(answer.get("valid", []))
        good = [s is not None and next(valid, False) is True for s in slots]
        self.counts["expired_leases"] += sum(s is not None for s in slots) - sum(good)
        return good

    async def _copied(self, keys: Sequence[bytes], outs: Sequence[Any] | None
                      ) -> tuple[list[bool], list[Block | None]]:
        """Lease ``keys``, copy each hit once (into ``outs[i]``, else a fresh array), release."""
        slots = await self._lease(keys)
        blocks: list[Block | None] = [None] * len(keys)
        try:
            views = [None if s is None else self._view(s) for s in slots]
            if outs is not None:  # every buffer checked before any is written
                for i, (view, out) in enumerate(zip(views, outs, strict=True)):
                    if view is not None:
                        check_output_spec(view.dtype, view.shape, out, f"outs[{i}]")
            for i, view in enumerate(views):  # the one copy of each block
                if view is None:
                    continue
                if outs is None:
                    blocks[i] = np.array(view, copy=True)
                else:
                    copy_into(view, outs[i], f"outs[{i}]")
        except BaseException:
            self._spawn(self._quiet("/v1/release",
                                    {"leases": [s["lease"] for s in slots if s is not None]}))
            raise
        del views
        good = await self._finish(slots)
        return good, [b if g else None for b, g in zip(blocks, good, strict=True)]

    async def _get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return (await self._copied(keys, None))[1]

    async def _get(self, key: bytes) -> Block | None:
        return (await self._get_many([key]))[0]

    async def _get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        return (await self._copied(keys, outs))[0]

    async def _get_into(self, key: bytes, out: Block) -> bool:
        return (await self._get_many_into([key], [out]))[0]

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        # The daemon's shared index answers without a call (a hint: a key it shows that is
        # gone by the lease is a miss then; see kvtier.shm.index).
        hinted = await self._client.present_many([self._k(k) for k in keys])
        if hinted is not None:
            self.counts["index_lookups"] += 1
            return hinted
        answer = await self._client.call("/v1/contains", {"keys": self._hex(keys)})
        present = answer.get("present")
        if not isinstance(present, list) or len(present) != len(keys):
            raise TierError(f"{self.name}: malformed contains answer")
        return [x is True for x in present]

    async def _contains(self, key: bytes) -> bool:
        return (await self._contains_many([key]))[0]

    # ----------------------------------------------------------------- writes
    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        if not items:
            return
        if self._client.info is None:
            await self._client.attach()
        capacity = self.capacity or 0
        for key, block in items:
            if block.nbytes > capacity:
                raise BlockTooLargeError(f"{self.name}: a {block.nbytes}-byte block for "
                                         f"{key.hex()} exceeds the daemon's {capacity} bytes")
        # The last value of a repeated key wins: only it is saved, so that no round of the
        # loop below can land an earlier value after it.
        todo = list({key: (key, block) for key, block in items}.values())
        while todo:
            # A round saves what the daemon has slots for now; its commit lets the daemon
            # evict (demote) for room, so a save larger than the arena's spare room goes on.
            left = await self._save_round(todo)
            if len(left) == len(todo):
                key, block = todo[0]
                raise TierFullError(f"{self.name}: no free slot in the daemon's arena for "
                                    f"{key.hex()} ({block.nbytes} bytes)")
            todo = left

    async def _save_round(self, items: list[tuple[bytes, Block]]
                          ) -> list[tuple[bytes, Block]]:
        """Prepare, copy and commit what the daemon lends slots for; the rest."""
        blocks = [{"key": self._k(k).hex(), "dtype": p.describe(b.dtype), "shape": list(b.shape)}
                  for k, b in items]
        answer = await self._client.call("/v1/prepare", {"blocks": blocks})
        slots = answer.get("slots")
        if not isinstance(slots, list) or len(slots) != len(items):
            raise TierError(f"{self.name}: malformed prepare answer")
        granted = [(block, slot) for (_k, block), slot in zip(items, slots, strict=True)
                   if slot is not None]
        if not granted:
            return items
        ids = [slot["lease"] for _b, slot in granted]
        try:
            if not await self._client.ensure(answer.get("instance")):
                raise TierError(f"{self.name}: the daemon restarted during the call")
            for block, slot in granted:
                target = self._view({**slot, "dtype": p.describe(block.dtype),
                                     "shape": list(block.shape)})
                np.copyto(target, block, casting="no")  # the one copy of a save
        except BaseException:
            self._spawn(self._quiet("/v1/commit", {"leases": ids, "abort": True}))
            raise
        # Not abandoned half-way: a commit cut short could land later, but never over a
        # newer value (the daemon orders commits by prepare).
        answer = await self._client.call("/v1/commit", {"leases": ids})
        committed = answer.get("committed")
        if answer.get("error"):
            raise TierError(f"{self.name}: the daemon refused the save: {answer['error']}")
        if not isinstance(committed, list) or not all(c is True for c in committed):
            raise TierError(f"{self.name}: the save's slots expired before its commit")
        self.counts["saved"] += len(granted)
        return [item for item, slot in zip(items, slots, strict=True) if slot is None]

    async def _put(self, key: bytes, block: Block) -> None:
        await self._put_many([(key, block)])

    async def _delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        answer = await self._client.call("/v1/delete", {"keys": self._hex(keys)})
        deleted = answer.get("deleted")
        if not isinstance(deleted, list) or len(deleted) != len(keys):
            raise TierError(f"{self.name}: malformed delete answer")
        return [x is True for x in deleted]

    async def _delete(self, key: bytes) -> bool:
        return (await self._delete_many([key]))[0]

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        # In the background: a lookup answered from the shared index waits on no call, and
        # a recency refresh that is lost (a stopped daemon) only ages the blocks.
        self._spawn(self._quiet("/v1/touch", {"keys": self._hex(keys)}))

    async def _pin(self, keys: Sequence[bytes]) -> None:
        await self._client.call("/v1/pin", {"keys": self._hex(keys)})

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        await self._client.call("/v1/unpin", {"keys": self._hex(keys)})

    async def daemon_stats(self) -> dict[str, Any]:
        """The daemon's lease and index figures (``leases``, ``prepared``, ``clients``,
        ``arena_used_bytes``, ``index_keys``, ``index_refused``, ...)."""
        return await self._client.call("/v1/stats")

    async def _aclose(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.timeout)
        await self._client.aclose()

    def stats(self) -> dict[str, Any]:
        """Tier figures plus ``leased`` (slots read), ``saved`` (blocks committed),
        ``expired_leases`` (copies thrown away: their lease ended under them),
        ``index_lookups`` (presence questions the shared index answered) and ``instance``
        (the daemon's arena)."""
        return {**super().stats(), **self.counts, "instance": self._client.instance}
