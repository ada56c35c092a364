"""Bad input to the store: a precise error naming the argument, and nothing changed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from kvtier.errors import BlockTooLargeError, ConfigError, InvalidKeyError, UnknownSchemeError
from kvtier.store import TieredStore, open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.tiers.dram import DRAMTier

KB = 1024


@pytest.fixture
async def store() -> AsyncIterator[TieredStore]:
    s = TieredStore([DRAMTier(capacity=4 * KB), DRAMTier(capacity=16 * KB)])
    for i in range(3):
        await s.put(key_of(i), sample_block(i))
    yield s
    await s.aclose()


async def snapshot(store: TieredStore) -> list[dict[bytes, bytes]]:
    out = []
    for tier in store.tiers:
        contents = {}
        for i in range(50):
            if await tier.contains(key_of(i)):
                block = await tier.get(key_of(i))
                assert block is not None
                contents[key_of(i)] = block.tobytes()
        out.append(contents)
    return out


BAD_KEYS: list[tuple[object, type[Exception]]] = [
    ("abc", TypeError), (bytearray(b"abc"), TypeError), (123, TypeError), (None, TypeError),
    (b"", InvalidKeyError), (b"x" * 129, InvalidKeyError),
]
BAD_VALUES: list[tuple[object, type[Exception]]] = [
    (np.arange(64, dtype=np.uint16)[::2], ValueError),  # not contiguous
    (np.arange(64, dtype=np.float32).reshape(8, 8).T, ValueError),  # Fortran order
    (np.array([object()] * 4, dtype=object), TypeError),
    ("a string", TypeError), (12345, TypeError), ([1, 2, 3], TypeError),
]


@pytest.mark.parametrize(("bad", "error"), BAD_KEYS)
async def test_bad_key_rejected_everywhere(store: TieredStore, bad: object,
                                           error: type[Exception]) -> None:
    before = await snapshot(store)
    calls: list[Any] = [
        store.put(bad, sample_block(9)),  # type: ignore[arg-type]
        store.get(bad),  # type: ignore[arg-type]
        store.contains(bad),  # type: ignore[arg-type]
        store.delete(bad),  # type: ignore[arg-type]
        store.get_into(bad, np.zeros(512, np.uint16)),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(error, match="key"):
            await call
    for batch in (store.get_many, store.contains_many, store.lookup_prefix, store.delete_many,
                  store.pin):
        with pytest.raises(error, match=r"keys\[1\]"):
            await batch([key_of(1), bad])  # type: ignore[list-item]
    with pytest.raises(error, match=r"items\[1\] key"):
        await store.put_many([(key_of(7), sample_block(7)), (bad, sample_block(8))])
    assert await snapshot(store) == before


async def test_keys_must_be_a_sequence_not_one_key(store: TieredStore) -> None:
    with pytest.raises(TypeError, match="keys"):
        await store.get_many(key_of(1))
    with pytest.raises(TypeError, match="items"):
        await store.put_many(b"abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"items\[0\]"):
        await store.put_many([key_of(1)])  # type: ignore[list-item]


@pytest.mark.parametrize(("bad", "error"), BAD_VALUES)
async def test_bad_value_rejected(store: TieredStore, bad: object,
                                  error: type[Exception]) -> None:
    before = await snapshot(store)
    with pytest.raises(error, match="value"):
        await store.put(key_of(1), bad)
    with pytest.raises(error, match=r"items\[1\] value"):
        await store.put_many([(key_of(7), sample_block(7)), (key_of(8), bad)])
    assert await snapshot(store) == before
    assert store.stats()["puts"] == 3


async def test_block_larger_than_every_tier(store: TieredStore) -> None:
    before = await snapshot(store)
    huge = np.zeros(32 * KB, np.uint8)
    with pytest.raises(BlockTooLargeError, match=r"value.*every tier"):
        await store.put(key_of(1), huge)
    with pytest.raises(BlockTooLargeError, match=r"items\[1\] value"):
        await store.put_many([(key_of(7), sample_block(7)), (key_of(8), huge)])
    assert await snapshot(store) == before


async def test_bad_out_buffer_leaves_it_untouched(store: TieredStore) -> None:
    with pytest.raises(TypeError, match="out"):
        await store.get_into(key_of(1), bytearray(1024))
    wrong = np.full(100, 3, np.uint16)
    with pytest.raises(ValueError, match="out"):
        await store.get_into(key_of(1), wrong)
    assert (wrong == 3).all()
    with pytest.raises(TypeError, match="outs"):
        await store.get_many_into([key_of(1)], np.zeros(4))


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"timeout": 0}, "timeout"), ({"timeout": -1.0}, "timeout"), ({"timeout": "1s"}, "timeout"),
    ({"timeout": True}, "timeout"), ({"promote": "some"}, "promote"), ({"promote": 0}, "promote"),
    ({"promote": True}, "promote"), ({"write_policy": "write_around"}, "write_policy"),
    ({"write_queue_size": 0}, "write_queue_size"), ({"write_workers": -2}, "write_workers"),
    ({"promote_counter_size": 1.5}, "promote_counter_size"),
])
def test_bad_store_options(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises((TypeError, ValueError), match=name):
        TieredStore([DRAMTier()], **kwargs)


def test_bad_tier_lists() -> None:
    with pytest.raises(TypeError, match="tiers"):
        TieredStore([])
    with pytest.raises(TypeError, match=r"tiers\[1\]"):
        TieredStore([DRAMTier(), "dram://"])  # type: ignore[list-item]
    tier = DRAMTier()
    with pytest.raises(ValueError, match="twice"):
        TieredStore([tier, tier])


async def test_bad_per_call_timeout(store: TieredStore) -> None:
    with pytest.raises(ValueError, match="timeout"):
        await store.get(key_of(1), timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        await store.get_many([key_of(1)], timeout="soon")  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", ["8QB", "-1", "abc", "1.5.2GiB"])
async def test_malformed_capacity_in_url(capacity: str) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        await open_store(["dram://?capacity=1MiB", f"dram://?capacity={capacity}"])


async def test_unknown_scheme_and_malformed_urls() -> None:
    with pytest.raises(UnknownSchemeError, match="nosuchtier"):
        await open_store(["dram://", "nosuchtier://x"])
    with pytest.raises(ConfigError, match="url"):
        await open_store(["no-scheme-here"])
    with pytest.raises(ConfigError, match="capcity"):
        await open_store(["dram://?capcity=1GiB"])
    with pytest.raises(TypeError, match="urls"):
        await open_store("dram://")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"urls\[0\]"):
        await open_store([42])  # type: ignore[list-item]


async def test_bad_pin_tier_index(store: TieredStore) -> None:
    for bad in (2, -3, "0", True):
        with pytest.raises(ValueError, match="tier"):
            await store.pin([key_of(1)], tier=bad)  # type: ignore[arg-type]
