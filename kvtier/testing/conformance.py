"""The conformance suite every tier passes.

Subclass :class:`TierConformance` in a test module (the subclass name must start with
``Test``) and implement :meth:`TierConformance.make_tier`::

    class TestDRAMConformance(TierConformance):
        async def make_tier(self, capacity):
            return DRAMTier(capacity=capacity)

Tests that need a byte budget skip when the subclass sets ``bounded = False``.

The worker-thread cases (``test_abandoned_*``) slow the tier's backend down with
:meth:`TierConformance.slow_backend`, give up on a call after a tiny deadline, then reuse the
buffer or write a newer value, and check that nothing the abandoned call started acts later.
By default the event loop's worker threads start late (:mod:`kvtier.testing.slow`); a tier
with threads or a server of its own overrides :meth:`~TierConformance.slow_backend` and
:meth:`~TierConformance.backend_idle`. A case skips when the call finished on time anyway
(nothing of the tier waited on the slowed backend).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from kvtier.deadline import Deadline, DeadlineExceeded
from kvtier.errors import BlockTooLargeError, ClosedError, ShapeMismatchError, TierError
from kvtier.testing.slow import SlowWorkerThreads, slow_worker_threads
from kvtier.tiers.base import Block, Tier

__all__ = ["TierConformance", "sample_block"]

BLOCK_BYTES = 1024
#: How late a slowed backend call starts, and how long the caller waits before it gives up.
SLOW_SECONDS = 0.2
GIVE_UP_SECONDS = 0.03
#: The (dtype, shape) pairs ``test_roundtrip_dtypes_and_shapes`` stores and reads back.
ROUNDTRIP_CASES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("|u1", (1024,)), ("<u2", (4, 16, 8)), ("<f2", (2, 2, 64)), ("<f4", (16, 16)),
    ("<i8", (3, 5)), ("|b1", (7,)), ("<f8", ()),
)

#: Keys every tier refuses (``test_bad_keys_rejected``).
BAD_KEYS: tuple[object, ...] = ("str-key", bytearray(b"k"), b"", b"x" * 129, 7, None)


def _mismatched_outs() -> dict[str, Block]:
    """Buffers a ``(8, 64)`` ``<f2`` block does not fit, fresh for each use."""
    return {"dtype": np.zeros((8, 64), dtype="<f4"), "shape": np.zeros((64, 8), dtype="<f2"),
            "size": np.zeros(100, dtype=np.uint8),
            "non-contiguous": np.zeros((8, 128), dtype="<f2")[:, ::2]}


def _bad_values() -> dict[str, object]:
    """Values every tier refuses to store."""
    return {"object": np.array([object(), object()]),
            "non-contiguous": np.zeros((8, 8), dtype=np.uint8)[:, ::2],
            "list": [1, 2, 3], "str": "text",
            "structured": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")])}


def sample_block(seed: int, nbytes: int = BLOCK_BYTES, dtype: str = "<u2") -> Block:
    """A deterministic pseudo-random block of ``nbytes`` bytes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8).view(np.dtype(dtype))


def key_of(i: int) -> bytes:
    """A 16-byte test key."""
    return i.to_bytes(4, "big") * 4


class TierConformance(abc.ABC):
    """Behaviour shared by every tier. See the module docstring for how to use it."""

    #: Whether the tier enforces its byte budget by evicting (remote pools may not).
    bounded: ClassVar[bool] = True
    #: Whether ``get`` refreshes recency in a way visible through eviction order.
    lru_visible: ClassVar[bool] = True

    tmp_path: Path

    @abc.abstractmethod
    async def make_tier(self, capacity: int | None) -> Tier:
        """Return a fresh, empty tier with byte budget ``capacity`` (``None``: unbounded)."""

    def capacity_for(self, n_blocks: int, block_nbytes: int = BLOCK_BYTES) -> int:
        """Budget that holds exactly ``n_blocks`` blocks of ``block_nbytes`` (override if the
        tier accounts per-block overhead)."""
        return n_blocks * block_nbytes

    @pytest.fixture(autouse=True)
    async def _kvtier_tiers(self, tmp_path: Path) -> AsyncIterator[None]:
        self.tmp_path = tmp_path
        self._created: list[Tier] = []
        # Before any tier exists, so every worker-thread call of the test goes through it.
        self.worker_threads: SlowWorkerThreads = slow_worker_threads()
        yield
        for tier in self._created:
            await tier.aclose()

    @contextlib.contextmanager
    def slow_backend(self, tier: Tier) -> Iterator[None]:
        """While open, ``tier``'s backend calls start :data:`SLOW_SECONDS` late.

        Default: the event loop's worker threads start late (:mod:`kvtier.testing.slow`).
        Override for a tier whose blocking calls run elsewhere (its own thread pool, a
        server), delaying the real backend, never replacing the tier's code.
        """
        self.worker_threads.delay = SLOW_SECONDS
        try:
            yield
        finally:
            self.worker_threads.delay = 0.0

    @contextlib.contextmanager
    def slow_started_backend(self, tier: Tier) -> Iterator[None]:
        """While open, ``tier``'s backend calls run at once but keep their worker thread
        :data:`SLOW_SECONDS` longer (a call that has started and takes long). Default: the
        event loop's worker threads; a tier whose calls run elsewhere overrides it (or
        its deadline checks skip)."""
        self.worker_threads.hold = SLOW_SECONDS
        try:
            yield
        finally:
            self.worker_threads.hold = 0.0

    async def backend_idle(self, tier: Tier) -> None:
        """Wait until every backend call slowed by :meth:`slow_backend` has ended."""
        await self.worker_threads.idle()

    async def tier(self, capacity: int | None = None) -> Tier:
        """Create a tier through :meth:`make_tier` and close it after the test."""
        made = await self.make_tier(capacity)
        self._created.append(made)
        return made

    def _need_budget(self) -> None:
        if not self.bounded:
            pytest.skip("tier does not enforce a local byte budget")

    # ----------------------------------------------------------------- basics
    async def test_roundtrip_dtypes_and_shapes(self) -> None:
        # Every case under a key of its own in one tier: a tier per case cost a server
        # fleet's start per case for the remote tiers.
        tier = await self.tier()
        rng = np.random.default_rng(1)
        blocks = [rng.integers(0, 2, size=shape).astype(dtype) if dtype == "|b1" else
                  rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                               dtype=np.uint8).view(dtype).reshape(shape)
                  for dtype, shape in ROUNDTRIP_CASES]
        for i, block in enumerate(blocks):
            await tier.put(key_of(i + 1), block)
        for i, block in enumerate(blocks):
            got = await tier.get(key_of(i + 1))
            case = f"{block.dtype.str} {block.shape}"
            assert got is not None, f"{case}: a miss"
            assert got.dtype == block.dtype and got.shape == block.shape, \
                f"{case}: came back as {got.dtype.str} {got.shape}"
            assert got.tobytes() == block.tobytes(), f"{case}: other bytes"

    async def test_bytes_value_stored_as_uint8(self) -> None:
        tier = await self.tier()
        await tier.put(key_of(1), b"hello kv")
        got = await tier.get(key_of(1))
        assert got is not None and got.dtype == np.uint8 and got.tobytes() == b"hello kv"

    async def test_put_copies_caller_buffer(self) -> None:
        tier = await self.tier()
        block = sample_block(2)
        await tier.put(key_of(1), block)
        block[:] = 0
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(2).tobytes()

    async def test_miss_is_none(self) -> None:
        tier = await self.tier()
        assert await tier.get(key_of(9)) is None
        assert await tier.contains(key_of(9)) is False

    async def test_overwrite(self) -> None:
        tier = await self.tier(self.capacity_for(4) if self.bounded else None)
        await tier.put(key_of(1), sample_block(1))
        used_one = tier.used
        await tier.put(key_of(1), sample_block(2))
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(2).tobytes()
        if self.bounded:
            assert tier.used == used_one

    async def test_delete(self) -> None:
        tier = await self.tier()
        await tier.put(key_of(1), sample_block(1))
        assert await tier.delete(key_of(1)) is True
        assert await tier.get(key_of(1)) is None
        assert await tier.contains(key_of(1)) is False
        assert await tier.delete(key_of(1)) is False

    async def test_batch_forms(self) -> None:
        tier = await self.tier()
        await tier.put_many([(key_of(i), sample_block(i)) for i in range(6)])
        keys = [key_of(i) for i in (0, 99, 3, 5)]
        got = await tier.get_many(keys)
        assert [g is None for g in got] == [False, True, False, False]
        assert got[2] is not None and got[2].tobytes() == sample_block(3).tobytes()
        assert await tier.contains_many(keys) == [True, False, True, True]
        assert await tier.delete_many([key_of(0), key_of(99)]) == [True, False]
        assert await tier.contains_many([key_of(0), key_of(1)]) == [False, True]

    async def test_get_into(self) -> None:
        tier = await self.tier()
        block = sample_block(3, dtype="<f2").reshape(8, 64)
        await tier.put(key_of(1), block)
        out = np.zeros((8, 64), dtype="<f2")
        assert await tier.get_into(key_of(1), out) is True
        assert out.tobytes() == block.tobytes()
        raw = np.zeros(block.nbytes, dtype=np.uint8)
        assert await tier.get_into(key_of(1), raw) is True
        assert raw.tobytes() == block.tobytes()
        assert await tier.get_into(key_of(2), out) is False

    async def test_get_into_mismatch_leaves_buffer_untouched(self) -> None:
        tier = await self.tier()
        await tier.put(key_of(1), sample_block(3, dtype="<f2").reshape(8, 64))
        for case, out in _mismatched_outs().items():
            out[...] = 7
            before = out.copy()
            with pytest.raises(ShapeMismatchError):
                await tier.get_into(key_of(1), out)
            assert np.array_equal(out, before), f"{case}: the buffer was written"

    # -------------------------------------------------------------- bad input
    # Each of these runs all its cases in one tier (a tier per case cost a server fleet's
    # start per case for the remote tiers).
    async def test_bad_keys_rejected(self) -> None:
        tier = await self.tier()
        await tier.put(key_of(1), sample_block(1))
        for bad_key in BAD_KEYS:
            for call in (tier.get(bad_key), tier.put(bad_key, sample_block(2)),  # type: ignore[arg-type]
                         tier.contains(bad_key), tier.delete(bad_key)):  # type: ignore[arg-type]
                with pytest.raises((TypeError, ValueError), match="key"):
                    await call
            with pytest.raises((TypeError, ValueError), match="keys"):
                await tier.get_many([key_of(1), bad_key])  # type: ignore[list-item]
            got = await tier.get(key_of(1))
            assert got is not None and got.tobytes() == sample_block(1).tobytes(), \
                f"key {bad_key!r}: the good block changed"

    async def test_bad_values_rejected(self) -> None:
        tier = await self.tier()
        for case, bad_value in _bad_values().items():
            with pytest.raises((TypeError, ValueError), match="value"):
                await tier.put(key_of(1), bad_value)
            with pytest.raises((TypeError, ValueError), match="value"):
                await tier.put_many([(key_of(2), sample_block(2)), (key_of(3), bad_value)])
            assert await tier.contains_many([key_of(1), key_of(2), key_of(3)]) == [False] * 3, \
                f"{case}: a block was stored"

    async def test_block_larger_than_capacity_rejected(self) -> None:
        self._need_budget()
        tier = await self.tier(self.capacity_for(2))
        await tier.put(key_of(1), sample_block(1))
        with pytest.raises(BlockTooLargeError):
            await tier.put(key_of(2), sample_block(2, nbytes=self.capacity_for(2) * 2))
        assert await tier.contains(key_of(2)) is False
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(1).tobytes()

    # ------------------------------------------------------- budget & eviction
    async def test_budget_never_exceeded_and_evictions_reported(self) -> None:
        self._need_budget()
        capacity = self.capacity_for(5)
        tier = await self.tier(capacity)
        evicted: dict[bytes, bytes] = {}

        async def on_evict(key: bytes, block: Block) -> None:
            assert await tier.contains(key), "evicted block must be readable until demoted"
            evicted[key] = block.tobytes()

        tier.on_evict = on_evict
        rng = np.random.default_rng(5)
        sizes = {}
        for i in range(40):
            nbytes = int(rng.integers(1, 3)) * BLOCK_BYTES // 2
            sizes[i] = nbytes
            await tier.put(key_of(i), sample_block(i, nbytes=nbytes, dtype="|u1"))
            assert tier.used <= capacity
        for i in range(40):
            got = await tier.get(key_of(i))
            expected = sample_block(i, nbytes=sizes[i], dtype="|u1").tobytes()
            if got is not None:
                assert got.tobytes() == expected
            else:
                assert evicted.get(key_of(i)) == expected, f"block {i} lost without demotion"
        assert tier.stats()["evictions"] >= 40 - 10

    async def test_contains_does_not_refresh_recency(self) -> None:
        self._need_budget()
        tier = await self.tier(self.capacity_for(3))
        for i in range(3):
            await tier.put(key_of(i), sample_block(i))
        assert await tier.contains(key_of(0))
        assert await tier.contains_many([key_of(0)]) == [True]
        await tier.put(key_of(3), sample_block(3))
        assert await tier.contains_many([key_of(i) for i in range(4)]) == [False, True, True, True]

    async def test_get_refreshes_recency(self) -> None:
        self._need_budget()
        if not self.lru_visible:
            pytest.skip("tier's eviction order is not LRU-observable")
        tier = await self.tier(self.capacity_for(3))
        for i in range(3):
            await tier.put(key_of(i), sample_block(i))
        assert await tier.get(key_of(0)) is not None
        await tier.put(key_of(3), sample_block(3))
        assert await tier.contains_many([key_of(i) for i in range(4)]) == [True, False, True, True]

    async def test_touch_chain_evicts_tail_first(self) -> None:
        self._need_budget()
        if not self.lru_visible:
            pytest.skip("tier's eviction order is not LRU-observable")
        tier = await self.tier(self.capacity_for(4))
        chain = [key_of(i) for i in range(4)]
        for i, key in enumerate(chain):
            await tier.put(key, sample_block(i))
        await tier.touch_chain(chain)
        await tier.put(key_of(10), sample_block(10))
        assert await tier.contains_many(chain) == [True, True, True, False]

    async def test_a_batch_into_a_full_tier_keeps_the_whole_batch(self) -> None:
        # Whatever the policy protects (here blocks read again, as a store's put_many then
        # touch_chain makes every stored block), a batch that fits the budget never evicts
        # its own blocks: the victims come from what was there before.
        self._need_budget()
        tier = await self.tier(self.capacity_for(8))
        for start in (0, 8, 16):
            batch = [key_of(i) for i in range(start, start + 6)]
            await tier.put_many([(k, sample_block(start + j)) for j, k in enumerate(batch)])
            await tier.touch_chain(batch)
            assert await tier.contains_many(batch) == [True] * 6, f"batch at {start}"
            assert tier.used <= self.capacity_for(8)

    async def test_pinned_blocks_not_evicted(self) -> None:
        self._need_budget()
        tier = await self.tier(self.capacity_for(3))
        await tier.put(key_of(0), sample_block(0))
        await tier.pin([key_of(0)])
        for i in range(1, 8):
            await tier.put(key_of(i), sample_block(i))
        assert await tier.contains(key_of(0))
        await tier.unpin([key_of(0)])
        for i in range(8, 12):
            await tier.put(key_of(i), sample_block(i))
        assert not await tier.contains(key_of(0))

    async def test_concurrent_puts_hold_budget(self) -> None:
        self._need_budget()
        capacity = self.capacity_for(8)
        tier = await self.tier(capacity)
        await asyncio.gather(*(tier.put(key_of(i), sample_block(i)) for i in range(64)))
        assert tier.used <= capacity
        present = await tier.contains_many([key_of(i) for i in range(64)])
        assert 1 <= sum(present) <= 8

    # ------------------------------------------------------- worker threads
    async def _give_up(self, tier: Tier, *calls: Awaitable[object]) -> int:
        """Run ``calls`` at once against the slowed backend, each given up on after
        :data:`GIVE_UP_SECONDS` (or the tier's own timeout); how many were given up on
        before they finished."""
        async def one(call: Awaitable[object]) -> bool:
            try:
                async with Deadline.after(GIVE_UP_SECONDS, "call"):
                    await call
            except (TimeoutError, TierError):  # DeadlineExceeded is a TimeoutError
                return True
            return False

        with self.slow_backend(tier):
            return sum(await asyncio.gather(*(one(c) for c in calls)))

    async def test_abandoned_get_into_never_writes_the_buffer_later(self) -> None:
        tier = await self.tier()
        block = sample_block(3, dtype="<f2").reshape(8, 64)
        await tier.put(key_of(1), block)
        out = np.zeros((8, 64), dtype="<f2")
        if not await self._give_up(tier, tier.get_into(key_of(1), out)):
            await self.backend_idle(tier)
            pytest.skip("get_into finished before the deadline: nothing waited on the backend")
        out[...] = 7  # the caller reuses its buffer (recomputes the block)
        await self.backend_idle(tier)
        assert np.all(out == 7), "a get_into that gave up wrote into the buffer afterwards"
        assert await tier.get_into(key_of(1), out) is True
        assert out.tobytes() == block.tobytes()

    async def test_abandoned_put_never_lands_over_a_newer_value(self) -> None:
        tier = await self.tier(self.capacity_for(4) if self.bounded else None)
        await tier.put(key_of(9), sample_block(9))  # set up (opened, connected)
        older = sample_block(1)
        gave_up = await self._give_up(tier, tier.put(key_of(1), older))
        older[...] = 0  # the caller reuses its buffer
        await tier.put(key_of(1), sample_block(2))
        await self.backend_idle(tier)
        if not gave_up:
            pytest.skip("put finished before the deadline: nothing waited on the backend")
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(2).tobytes(), \
            "an abandoned put landed over the newer value"

    async def test_abandoned_put_never_reads_the_buffer_later(self) -> None:
        tier = await self.tier(self.capacity_for(4) if self.bounded else None)
        await tier.put(key_of(9), sample_block(9))  # set up (opened, connected)
        buffer = sample_block(3)
        gave_up = await self._give_up(tier, tier.put(key_of(3), buffer))
        buffer[...] = 0  # the caller reuses its buffer
        await self.backend_idle(tier)
        if not gave_up:
            pytest.skip("put finished before the deadline: nothing waited on the backend")
        got = await tier.get(key_of(3))  # stored or not, never the reused buffer
        assert got is None or got.tobytes() == sample_block(3).tobytes(), \
            "an abandoned put stored what its caller wrote after giving up"

    async def test_abandoned_puts_are_counted_or_gone(self) -> None:
        self._need_budget()
        capacity = self.capacity_for(4)
        tier = await self.tier(capacity)
        await tier.put(key_of(9), sample_block(9))  # set up (opened, connected)
        buffers = [sample_block(i) for i in range(8)]
        gave_up = await self._give_up(tier, *(tier.put(key_of(i), b)
                                              for i, b in enumerate(buffers)))
        for buffer in buffers:
            buffer[...] = 0  # the callers reuse their buffers
        await self.backend_idle(tier)
        if not gave_up:
            pytest.skip("puts finished before the deadline: nothing waited on the backend")
        keys = [key_of(i) for i in range(8)]
        held = sum(await tier.contains_many([*keys, key_of(9)]))
        assert tier.used <= capacity
        assert tier.used >= held * BLOCK_BYTES, "abandoned puts landed uncounted"
        for i in range(8):  # whatever landed is the value put, never the reused buffer
            got = await tier.get(key_of(i))
            assert got is None or got.tobytes() == sample_block(i).tobytes(), \
                f"block {i} holds what its caller wrote after giving up"
        if self.lru_visible:  # and it is evictable: newer blocks push it out
            for i in range(8, 16):
                await tier.put(key_of(i), sample_block(i))
            assert not any(await tier.contains_many(keys))

    # --------------------------------------------------------------- deadline
    async def _put_under_deadline(self, tier: Tier, key: bytes,
                                  block: Block) -> DeadlineExceeded | None:
        try:
            async with Deadline.after(GIVE_UP_SECONDS, "put"):
                await tier.put(key, block)
        except DeadlineExceeded as exc:
            return exc
        return None

    async def test_a_queued_call_is_cancelled_at_its_deadline(self) -> None:
        tier = await self.tier(self.capacity_for(4) if self.bounded else None)
        await tier.put(key_of(9), sample_block(9))  # set up (opened, connected)
        with self.slow_backend(tier):
            error = await self._put_under_deadline(tier, key_of(1), sample_block(1))
        await self.backend_idle(tier)
        if error is None or not error.cancelled:
            pytest.skip("no worker-thread call of this tier was queued at the deadline")
        assert "had not started" in str(error)
        assert await tier.get(key_of(1)) is None, "a call cancelled at its deadline ran later"
        await tier.put(key_of(1), sample_block(2))
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(2).tobytes()

    async def test_a_queued_read_is_cancelled_at_its_deadline(self) -> None:
        tier = await self.tier(self.capacity_for(4) if self.bounded else None)
        await tier.put(key_of(1), sample_block(1))
        error: DeadlineExceeded | None = None
        with self.slow_backend(tier):
            try:
                async with Deadline.after(GIVE_UP_SECONDS, "get"):
                    await tier.get(key_of(1))
            except DeadlineExceeded as exc:
                error = exc
            except TierError:  # the tier's own timeout: a read it gave up on
                pass
        await self.backend_idle(tier)
        if error is None or not error.cancelled:
            pytest.skip("no worker-thread read of this tier was queued at the deadline")
        assert "had not started" in str(error)
        got = await tier.get(key_of(1))  # the cancelled read left the tier as it was
        assert got is not None and got.tobytes() == sample_block(1).tobytes()

    async def test_a_started_call_is_awaited_at_its_deadline(self) -> None:
        tier = await self.tier(self.capacity_for(4) if self.bounded else None)
        await tier.put(key_of(9), sample_block(9))
        with self.slow_started_backend(tier):
            error = await self._put_under_deadline(tier, key_of(1), sample_block(1))
        if error is None or not error.awaited:
            await self.worker_threads.idle()
            pytest.skip("no worker-thread call of this tier had started at the deadline")
        assert "had started" in str(error)
        # Raised only once the started write had ended: what it wrote is there, counted.
        got = await tier.get(key_of(1))
        assert got is not None and got.tobytes() == sample_block(1).tobytes()
        await self.worker_threads.idle()

    # ------------------------------------------------------------------ close
    async def test_close_is_idempotent_and_final(self) -> None:
        tier = await self.make_tier(None)
        await tier.put(key_of(1), sample_block(1))
        await tier.aclose()
        await tier.aclose()
        assert tier.closed
        with pytest.raises(ClosedError):
            await tier.get(key_of(1))
        with pytest.raises(ClosedError):
            await tier.put(key_of(2), sample_block(2))

    async def test_concurrent_aclose_returns_once_closed(self) -> None:
        tier = await self.make_tier(None)
        await tier.put(key_of(1), sample_block(1))
        first = asyncio.ensure_future(tier.aclose())
        await asyncio.sleep(0)
        await tier.aclose()  # a second close returns only once the first has finished
        assert first.done()
        await first
        await tier.aclose()
        assert tier.closed
