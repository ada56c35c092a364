"""Budgeted tiers: a byte budget over a pluggable policy, and the one eviction template that
dram, hbm, lmdb and fsspec share.

Eviction in three steps (cachetools' one hook, diskcache's bounded steps):

1. **choose and detach** (one synchronous step, so no other coroutine of the tier sees it
   half done): the policy picks victims; they leave the policy and enter the ``leaving``
   map, still stored and still readable (``get``/``contains`` find them there,
   :meth:`BudgetedTier._held`); the put claims the bytes it adds beyond its victims.
2. **demote** outside any lock: each victim goes to the eviction callback (the store writes
   it to the tier below) in steps of at most ``STEP_BLOCKS`` blocks / ``STEP_BYTES`` bytes.
   Other puts choose other victims and demote at the same time. When the callback raises
   (no tier below took a victim: a full disk), the eviction is abandoned: every victim of
   the put goes back into the policy and the put raises, so a block is never lost because
   a lower tier refused it, and the tier never goes over its budget.
3. **drop and commit**: victims pinned meanwhile are kept (back into the policy, and the put
   chooses again); the others are dropped in the same step that writes the new blocks
   (:meth:`BudgetedTier._commit`), which a cancelled put waits for (it reads the put's
   block, maybe in a worker thread) unless it cannot yield. From the
   moment their drop begins they are no longer claimed (``Leaving.dropping``): storage may
   lose them before the tier hears back (an LMDB commit in a worker thread, a file removed
   before the new blocks are written), and a tier must never claim a block it cannot read.
   They were demoted in step 2, so readers find them below; their bytes stay counted until
   the drop ends.

Budget: ``policy.used + leaving bytes + claimed bytes <= capacity`` holds at every step, so
what the tier holds never exceeds its capacity. A put of a key that is leaving, and a delete
of one, first wait for that eviction to finish (a deleted key is never demoted afterwards).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from kvtier.errors import BlockTooLargeError, ConfigError, TierFullError
from kvtier.policy import ARCPolicy, Clock, RecencyPolicy, S3FIFOPolicy
from kvtier.tiers.base import Block, Tier, run_to_end
from kvtier.tiers.eviction_state import EvictionState, Leaving

__all__ = ["POLICIES", "STEP_BLOCKS", "STEP_BYTES", "BudgetedTier", "Leaving", "Policy",
           "make_policy", "parse_policy"]

Policy = RecencyPolicy | S3FIFOPolicy | ARCPolicy
#: ``policy=`` URL option values of every budgeted tier.
POLICIES: Mapping[str, type[Policy]] = {"lru": RecencyPolicy, "s3fifo": S3FIFOPolicy,
                                        "arc": ARCPolicy}
#: One demotion step reads and hands down at most this many victims / bytes.
STEP_BLOCKS = 64
STEP_BYTES = 64 << 20


def parse_policy(value: object, name: str = "policy") -> str:
    """Validate a ``policy=`` option: ``lru`` (default), ``s3fifo`` or ``arc``.

    Raises
    ------
    ConfigError
        Naming the option and the accepted values.
    """
    text = "lru" if value in (None, "") else str(value).strip().lower()
    if text not in POLICIES:
        raise ConfigError(f"{name}: expected one of {', '.join(POLICIES)}, got {value!r}")
    return text


def make_policy(policy: str, capacity: int | None, clock: Clock = time.monotonic) -> Policy:
    """The policy named ``policy`` (see :data:`POLICIES`) over ``capacity`` bytes.

    Raises
    ------
    ConfigError
        For an unknown policy, or a capacity of 0, which would hold no block: every put
        refused, a tier that silently does nothing.
    """
    if capacity is not None and capacity <= 0:
        raise ConfigError(f"capacity: {capacity} bytes holds no block; give a size such as "
                          "8GiB (or no capacity for an unbounded tier)")
    return POLICIES[parse_policy(policy)](capacity, clock)


def _steps(entries: list[Leaving]) -> list[list[Leaving]]:
    steps: list[list[Leaving]] = []
    current: list[Leaving] = []
    nbytes = 0
    for entry in entries:
        if current and (len(current) >= STEP_BLOCKS or nbytes >= STEP_BYTES):
            steps.append(current)
            current, nbytes = [], 0
        current.append(entry)
        nbytes += entry.size
    if current:
        steps.append(current)
    return steps


class BudgetedTier(Tier):
    """A :class:`Tier` whose recency, pins and byte accounting live in ``self._policy``, and
    whose puts evict through :meth:`_store_evicting` (see the module docstring).

    Subclasses set ``self._policy`` (:func:`make_policy`) in ``__init__`` and implement
    :meth:`_commit` (drop victims, write new blocks); they override :meth:`_detach` /
    :meth:`_reattach` when they hold blocks in memory, :meth:`_read_leaving` when a victim
    must be read back from storage to be demoted, and :meth:`_drop_stored`. What the template
    has in flight lives in ``self._eviction_state`` (:class:`EvictionState`), which
    subclasses only ask.

    Concurrency: any number of puts, gets and deletes may run at once; puts that need
    victims demote them concurrently. ``_get``/``_contains`` of subclasses that keep no index
    of their own answer with :meth:`_held` (the policy and the victims still readable).
    """

    _policy: Policy
    #: Whether :meth:`_commit` never yields (then it needs no shield and no pin).
    _atomic_commit: ClassVar[bool] = False

    def __init__(self, *, name: str | None = None) -> None:
        super().__init__(name=name)
        self._eviction_state = EvictionState()

    @property
    def capacity(self) -> int | None:
        return self._policy.capacity

    @property
    def used(self) -> int:
        return self._policy.used + self._eviction_state.leaving_bytes

    @property
    def policy_name(self) -> str:
        """``lru``, ``s3fifo`` or ``arc``."""
        return next(n for n, cls in POLICIES.items() if type(self._policy) is cls)

    async def _touch_chain(self, keys: Sequence[bytes]) -> None:
        self._policy.touch_chain(keys)

    async def _pin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._policy.pin(key)

    async def _unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._policy.unpin(key)

    def _held(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` readably: admitted, or a victim whose drop from
        storage has not begun."""
        if key in self._policy:
            return True
        entry = self._eviction_state.leaving_entry(key)
        return entry is not None and not entry.dropping

    def resident_keys(self) -> list[bytes] | None:
        """Keys held, least recently used first (from the recency policy)."""
        return list(self._policy.lru_order())

    def stats(self) -> dict[str, Any]:
        """Tier figures plus ``blocks`` (held now), ``pinned_bytes``, ``leaving`` (victims
        being demoted) and ``policy``."""
        leaving = self._eviction_state.leaving_count
        return {**super().stats(), "blocks": len(self._policy) + leaving,
                "pinned_bytes": self._policy.pinned_bytes, "leaving": leaving,
                "policy": self.policy_name}

    async def _put_many(self, items: Sequence[tuple[bytes, Block]]) -> None:
        """Put in order, each piece of the batch that fits the budget pinned while it goes
        in: block by block, a policy that protects blocks read again (s3fifo, arc) evicts
        the batch's own earlier blocks into a full tier (of a 64-block save into the host
        daemon's full arc tier, one block stayed)."""
        capacity = self._policy.capacity
        pieces: list[list[tuple[bytes, Block]]] = [[]]
        nbytes = 0
        for key, block in items:
            if pieces[-1] and capacity is not None and nbytes + block.nbytes > capacity:
                pieces.append([])
                nbytes = 0
            pieces[-1].append((key, block))
            nbytes += block.nbytes
        for piece in pieces:
            keys = [k for k, _ in piece]
            for key in keys:
                self._policy.pin(key)
            try:
                for key, block in piece:
                    await self._put(key, block)
            finally:
                self._unpin_all(keys)

    # ------------------------------------------------------------ storage hooks
    async def _commit(self, items: Sequence[tuple[bytes, Block]],
                      dropped: list[bytes]) -> list[int] | None:
        """Remove ``dropped`` (demoted victims) from storage and store ``items``; return
        the budget bytes of each item when they differ from the sizes given to
        :meth:`_store_evicting`. ``dropped`` must be gone even when the write fails."""
        raise TypeError(f"{type(self).__name__} stores through its own _put")

    def _detach(self, key: bytes) -> Block | None:
        """Take ``key``'s block out of the tier's own index when it becomes a victim; return
        it when the tier holds it in memory (it then lives in the leaving map)."""
        return None

    def _reattach(self, entry: Leaving) -> None:
        """Undo :meth:`_detach` for a victim that is kept (pinned meanwhile, or cancelled)."""

    def _dropped(self, entry: Leaving) -> None:
        """A victim left the tier for good (release its memory)."""

    async def _read_leaving(self, keys: list[bytes]) -> list[Block | None]:
        """Read victims back for demotion (``None``: unreadable, dropped undemoted)."""
        return [None] * len(keys)

    async def _drop_stored(self, keys: list[bytes]) -> None:
        """Remove victims from storage outside a commit (when a kept victim cut it short)."""

    def _unavailable(self) -> int:
        """Bytes of the capacity the tier cannot use now (hbm: engine-reserved slots)."""
        return 0

    # ----------------------------------------------------------------- template
    def _busy(self) -> bool:
        """Whether any eviction or evicting put is in flight (then :meth:`_settled` may
        have to wait)."""
        return self._eviction_state.busy

    async def _settled(self, keys: Sequence[bytes]) -> None:
        """Wait until none of ``keys`` is leaving (its demotion and drop have finished) or
        being written by a put that is still making room."""
        await self._eviction_state.settled(keys)

    def _fits_now(self, sizes: Mapping[bytes, int]) -> bool:
        capacity = self._policy.capacity
        if capacity is None:
            return True
        policy = self._policy
        incoming = sum(sizes.values()) - sum(policy.size_of(k) or 0 for k in sizes)
        state = self._eviction_state
        return (policy.used + state.leaving_bytes + state.claimed + self._unavailable()
                + incoming <= capacity)

    def _choose(self, sizes: Mapping[bytes, int]) -> tuple[list[bytes], int] | None:
        """Victims that make room for ``sizes`` and the bytes the put claims beyond them;
        ``None`` when the room can only come from evictions in flight (wait, then retry).
        The keys of ``sizes`` are pinned by the caller, so they are never chosen."""
        policy = self._policy
        incoming = sum(sizes.values()) - sum(policy.size_of(k) or 0 for k in sizes)
        if policy.capacity is None:
            return [], max(0, incoming)
        in_flight = self._eviction_state.leaving_bytes + self._eviction_state.claimed
        try:
            victims = policy.victims(incoming + in_flight + self._unavailable())
        except (TierFullError, BlockTooLargeError):
            if in_flight:
                return None
            raise
        freed = sum(policy.size_of(v) or 0 for v in victims)
        return victims, max(0, incoming - freed)

    def _detach_all(self, victims: list[bytes]) -> list[Leaving]:
        entries = []
        for key in victims:
            size = self._policy.remove(key) or 0
            entry = Leaving(key, size, self._detach(key))
            self._eviction_state.add_leaving(entry)
            entries.append(entry)
        return entries

    @staticmethod
    def _begin_drop(entries: Iterable[Leaving]) -> None:
        """Stop claiming victims whose drop from storage starts now (module docstring)."""
        for entry in entries:
            entry.dropping = True

    def _end_leaving(self, entry: Leaving, *, keep: bool) -> None:
        if self._eviction_state.remove_leaving(entry):
            if keep:
                self._policy.admit(entry.key, entry.size)
                self._reattach(entry)
            else:
                self._dropped(entry)
                self._report_dropped((entry.key,))
        entry.block = None
        if entry.done is not None and not entry.done.done():
            entry.done.set_result(None)

    async def _demote(self, entries: list[Leaving]) -> None:
        """Hand victims to the eviction callback, step by step; they stay readable."""
        for step in _steps(entries):
            unread = [e.key for e in step if e.block is None]
            read = dict(zip(unread, await self._read_leaving(unread), strict=True)) \
                if unread else {}
            for entry in step:
                block = entry.block if entry.block is not None else read.get(entry.key)
                # A victim deleted meanwhile is not demoted (it would come back below).
                if block is not None and self._eviction_state.leaving_entry(entry.key) is entry:
                    await self._evict(entry.key, block)

    async def _store_evicting(self, items: Sequence[tuple[bytes, Block]],
                              sizes: Sequence[int]) -> None:
        """Store ``items`` (budget bytes ``sizes``) through :meth:`_commit`, evicting first.

        Raises
        ------
        TierFullError
            If pinned blocks leave no room (nothing changes).
        """
        if (self._atomic_commit and len(items) == 1 and not self._eviction_state.busy
                and not self._eviction_state.claimed):
            # The hot path (one block into a tier that holds blocks in memory): nothing in
            # flight, so choosing, evicting (when there is nothing to demote to) and
            # committing are one synchronous step.
            key = items[0][0]
            size = sizes[0]
            policy = self._policy
            capacity = policy.capacity
            if capacity is None or policy.used + size - (policy.size_of(key) or 0) <= capacity:
                await self._commit(items, [])
                policy.admit(key, size)
                return
            if self.on_evict is None:
                for victim in policy.victims(size, replacing=key):
                    self.evictions += 1
                    victim_size = policy.remove(victim) or 0
                    self._dropped(Leaving(victim, victim_size, self._detach(victim)))
                    self._report_dropped((victim,))
                await self._commit(items, [])
                policy.admit(key, size)
                return
        keys = [k for k, _ in items]
        wanted = dict(zip(keys, sizes, strict=True))
        if self._busy():
            await self._settled(keys)
            if self._atomic_commit and self._fits_now(wanted):
                await self._commit(items, [])
                for key, size in wanted.items():
                    self._policy.admit(key, size)
                return
        await self._evict_and_commit(items, wanted)

    def _unpin_all(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._policy.unpin(key)

    async def _evict_and_commit(self, items: Sequence[tuple[bytes, Block]],
                                wanted: dict[bytes, int]) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in wanted:
            self._policy.pin(key)  # never a victim of a concurrent put while written
        self._eviction_state.start_writing(wanted, done)
        try:
            entries, claim = await self._make_room(wanted)
        except BaseException:
            self._unpin_all(wanted)
            self._eviction_state.written(wanted, done)
            raise
        finish = self._finish(items, wanted, entries, claim, done)  # unpins
        if self._atomic_commit:
            await finish
            return
        # Run to its end even if the put is cancelled: storage and accounting must not come
        # apart, and the commit reads the caller's block (in a worker thread, maybe), which
        # the caller may reuse as soon as the put returns.
        task = asyncio.ensure_future(finish)
        self._eviction_state.track_commit(task)
        await run_to_end(task)

    async def _make_room(self, wanted: dict[bytes, int]) -> tuple[list[Leaving], int]:
        """Choose, detach and demote victims until the ones left are enough; return them
        (still leaving) and the bytes claimed beyond them."""
        while True:
            chosen = self._choose(wanted)
            if chosen is None:
                await self._eviction_state.wait_for_room()
                continue
            victims, claim = chosen
            entries = self._detach_all(victims)
            self._eviction_state.claim(claim)
            try:
                if entries:
                    await self._demote(entries)
            except BaseException:
                self._eviction_state.release(claim)
                for entry in entries:
                    self._end_leaving(entry, keep=True)  # nothing changed
                self._eviction_state.room_changed()
                raise
            kept = [e for e in entries if self._policy.is_pinned(e.key)]
            if not kept:
                break
            # Pinned while being demoted: the engine uses it now. Keep it, choose again.
            self._eviction_state.release(claim)
            for entry in kept:
                self._end_leaving(entry, keep=True)
            rest = [e for e in entries if e not in kept]
            self._begin_drop(rest)
            try:
                await self._drop_stored([e.key for e in rest])
            finally:
                for entry in rest:
                    self._end_leaving(entry, keep=False)
                self._eviction_state.room_changed()
        return entries, claim

    async def _finish(self, items: Sequence[tuple[bytes, Block]], wanted: dict[bytes, int],
                      entries: list[Leaving], claim: int, done: asyncio.Future[None]) -> None:
        self._begin_drop(entries)
        try:
            actual = await self._commit(items, [e.key for e in entries])
            for (key, _), size in zip(items, actual or wanted.values(), strict=True):
                self._policy.admit(key, size)
        finally:
            self._eviction_state.release(claim)
            for entry in entries:
                self._end_leaving(entry, keep=False)
            self._unpin_all(wanted)
            self._eviction_state.written(wanted, done)
            self._eviction_state.room_changed()

    async def _evict_more(self, nbytes: int) -> bool:
        """Evict about ``nbytes`` more than the budget asks for (a store that ran out of
        room before its budget did), through the same detach/demote/drop steps. Returns
        whether anything was evicted."""
        chosen: list[bytes] = []
        for key in self._policy.lru_order():
            if nbytes <= 0:
                break
            if not self._policy.is_pinned(key):
                chosen.append(key)
                nbytes -= self._policy.size_of(key) or 0
        return await self._evict_keys(chosen)

    async def _evict_keys(self, keys: list[bytes]) -> bool:
        """Evict these (present, unpinned) keys through the detach/demote/drop steps; a key
        pinned meanwhile is kept. Returns whether anything was evicted."""
        entries = self._detach_all([k for k in keys if k in self._policy])
        try:
            await self._demote(entries)
        except BaseException:
            for entry in entries:
                self._end_leaving(entry, keep=True)
            raise
        kept = [e for e in entries if self._policy.is_pinned(e.key)]
        rest = [e for e in entries if e not in kept]
        for entry in kept:
            self._end_leaving(entry, keep=True)
        self._begin_drop(rest)
        try:
            await self._drop_stored([e.key for e in rest])
        finally:
            for entry in rest:
                self._end_leaving(entry, keep=False)
            self._eviction_state.room_changed()
        return bool(rest)

    async def _commits_done(self) -> None:
        """Wait for shielded commits still running (call from ``_aclose``)."""
        await self._eviction_state.commits_done()
