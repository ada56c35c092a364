"""A reusable hypothesis state machine that checks a whole tier chain against a dict model.

Build a machine for any chain of tiers and run its ``TestCase`` under pytest::

    from kvtier.testing.chain import make_chain_machine

    def tiers():
        return [DRAMTier(capacity=3 * 1024), DRAMTier(capacity=5 * 1024),
                DRAMTier(capacity=8 * 1024)]

    TestDRAMChain = make_chain_machine(tiers).TestCase

Budgets should be a few blocks each so that eviction and demotion happen on most steps.
After every step the machine checks that no tier exceeds its byte budget and that every key
put and not deleted is present in some tier, unless the *last* tier evicted it by budget
(tracked through the last tier's ``on_evict``, which the store leaves alone). Every value a
read returns, and every copy a tier holds after a read promoted it, must equal the last value
put (lower copies shadowed by a newer one may be stale); deleted keys must stay deleted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import hypothesis
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.store import TieredStore
from kvtier.testing.conformance import sample_block
from kvtier.tiers.base import Block, Tier

__all__ = ["DEFAULT_BLOCK_SIZES", "STORE_VARIANTS", "make_chain_machine"]

T = TypeVar("T")
DEFAULT_BLOCK_SIZES = (512, 1024, 1536, 2048)
#: Store configurations the machine draws from (one per run).
STORE_VARIANTS: tuple[Mapping[str, Any], ...] = (
    {},
    {"promote": "top"},
    {"promote": 2},
    {"write_policy": "write_through", "write_workers": 2, "write_queue_size": 4},
)


def make_chain_machine(
    tier_factory: Callable[[], Sequence[Tier]],
    *,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    n_keys: int = 12,
    store_variants: Sequence[Mapping[str, Any]] = STORE_VARIANTS,
    cleanup: Callable[[], None] | None = None,
    settings: hypothesis.settings | None = None,
) -> type[RuleBasedStateMachine]:
    """Return a state machine class testing ``TieredStore(tier_factory(), **variant)``.

    Parameters
    ----------
    tier_factory
        Returns fresh, empty tiers (top first) for each run; the store closes them.
    block_sizes
        Byte sizes of the ``<u2`` blocks the machine writes.
    n_keys
        Size of the key pool (small, so keys are overwritten and re-read often).
    store_variants
        ``TieredStore`` keyword options; each run draws one.
    cleanup
        Called after each run's store is closed (e.g. to remove temporary directories).
    settings
        Hypothesis settings of the machine's ``TestCase`` (``None``: hypothesis's defaults).
    """
    keys = [i.to_bytes(2, "big") * 8 for i in range(n_keys)]
    key_st = st.sampled_from(keys)
    block_st = st.tuples(st.sampled_from(list(block_sizes)), st.integers(0, 2**16))

    class ChainMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.store: TieredStore | None = None
            self.model: dict[bytes, Block] = {}
            self.lost: set[bytes] = set()

        def run(self, coro: Coroutine[Any, Any, T]) -> T:
            return self.loop.run_until_complete(coro)

        @property
        def s(self) -> TieredStore:
            assert self.store is not None
            return self.store

        @initialize(variant=st.sampled_from(list(store_variants)))
        def open(self, variant: Mapping[str, Any]) -> None:
            async def make() -> TieredStore:
                return TieredStore(list(tier_factory()), **variant)

            self.store = self.run(make())
            last = self.store.tiers[-1]
            assert last.on_evict is None, "the store must not hook the last tier's evictions"

            async def dropped(key: bytes, block: Block) -> None:
                self.lost.add(key)

            last.on_evict = dropped

        def teardown(self) -> None:
            try:
                if self.store is not None:
                    self.run(self.store.aclose())
            finally:
                self.loop.close()
                if cleanup is not None:
                    cleanup()

        # ------------------------------------------------------------ checks
        def expect(self, key: bytes, got: Block | None) -> None:
            want = self.model.get(key)
            if want is None:
                assert got is None, f"{key.hex()} was deleted or never put, but read back"
                return
            if got is None:
                assert key in self.lost, f"{key.hex()} vanished without the last tier evicting it"
                return
            assert got.dtype == want.dtype and got.shape == want.shape, key.hex()
            assert got.tobytes() == want.tobytes(), f"{key.hex()}: stale or corrupt value"

        async def tier_copies(self, key: bytes) -> list[tuple[int, Block | None]]:
            found = []
            for i, tier in enumerate(self.s.tiers):
                if await tier.contains(key):
                    found.append((i, await tier.get(key)))
            return found

        # ------------------------------------------------------------ rules
        @rule(key=key_st, block=block_st)
        def put(self, key: bytes, block: tuple[int, int]) -> None:
            value = sample_block(block[1], block[0])
            # Before the call: the put itself may push the new block out of the last tier.
            self.lost.discard(key)
            self.model[key] = value
            self.run(self.s.put(key, value))

        @rule(items=st.lists(st.tuples(key_st, block_st), min_size=1, max_size=6))
        def put_many(self, items: list[tuple[bytes, tuple[int, int]]]) -> None:
            values = [(k, sample_block(seed, size)) for k, (size, seed) in items]
            for key, value in values:
                self.model[key] = value
                self.lost.discard(key)
            self.run(self.s.put_many(values))

        @rule(key=key_st)
        def get(self, key: bytes) -> None:
            before = {i for i, _ in self.run(self.tier_copies(key))}
            got = self.run(self.s.get(key))
            self.expect(key, got)
            copies = self.run(self.tier_copies(key))
            for rank, (index, copy) in enumerate(copies):
                assert copy is not None, (f"tier {index} claims {key.hex()} but cannot read "
                                          f"it; its stats: {self.s.tiers[index].stats()}")
                # The topmost copy is what readers see, and a copy the get just promoted must
                # be identical; older copies further down may be stale (write_back overwrites
                # them only when the newer block is demoted onto them).
                if rank == 0 or index not in before:
                    self.expect(key, copy)

        @rule(chain=st.lists(key_st, min_size=1, max_size=6))
        def get_many(self, chain: list[bytes]) -> None:
            for key, got in zip(chain, self.run(self.s.get_many(chain)), strict=True):
                self.expect(key, got)

        @rule(key=key_st)
        def get_into(self, key: bytes) -> None:
            want = self.model.get(key)
            out = np.zeros_like(want) if want is not None else np.zeros(8, np.uint16)
            hit = self.run(self.s.get_into(key, out))
            self.expect(key, out if hit else None)

        @rule(key=key_st)
        def delete(self, key: bytes) -> None:
            removed = self.run(self.s.delete(key))
            if key in self.model and key not in self.lost:
                assert removed, f"{key.hex()} was present but delete said it was not"
            elif key not in self.model:
                assert not removed, f"{key.hex()} was never put or already deleted"
            self.model.pop(key, None)
            self.lost.discard(key)

        @rule(chain=st.lists(key_st, min_size=1, max_size=8))
        def lookup_prefix(self, chain: list[bytes]) -> None:
            hit = self.run(self.s.lookup_prefix(chain))
            assert 0 <= hit <= len(chain)
            for key in chain[:hit]:
                assert key in self.model, f"prefix claims deleted/unknown key {key.hex()}"
            if hit < len(chain):
                gap = chain[hit]
                assert gap not in self.model or gap in self.lost, (
                    f"prefix stopped at {gap.hex()} which must be present")

        @rule(key=key_st)
        def contains(self, key: bytes) -> None:
            present = self.run(self.s.contains(key))
            if key not in self.model:
                assert not present
            elif key not in self.lost:
                assert present

        @rule()
        def flush(self) -> None:
            self.run(self.s.flush())

        # ------------------------------------------------------------ invariants
        @invariant()
        def budgets_hold(self) -> None:
            if self.store is None:
                return
            for tier in self.store.tiers:
                if tier.capacity is not None:
                    assert tier.used <= tier.capacity, f"{tier!r} is over budget"

        @invariant()
        def nothing_lost_or_resurrected(self) -> None:
            if self.store is None:
                return

            async def present(key: bytes) -> bool:
                return any([await t.contains(key) for t in self.s.tiers])

            for key in keys:
                here = self.run(present(key))
                if key in self.model and key not in self.lost:
                    assert here, f"{key.hex()} is in no tier but the last tier never evicted it"
                elif key not in self.model:
                    assert not here, f"deleted key {key.hex()} came back"

    if settings is not None:
        ChainMachine.TestCase.settings = settings
    return ChainMachine
