"""``KVTierHiCacheStorage`` loaded the way SGLang's ``dynamic`` factory loads it, against a fake
host pool with the attributes SGLang's backends use; and one keyspace shared with vLLM."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier import ConfigError
from kvtier.integrations.sglang import KVTierHiCacheStorage, sglang_available
from kvtier.tiers import registry
from kvtier.tiers.dram import DRAMTier
from tests.helpers.vllm_fakes import BLOCK, FakeEngine, Request

PAGE = 4


class FakeHostPool:
    """A page-first host pool: ``kv_buffer[slot]`` holds one token across layers."""

    def __init__(self, slots: int, token_shape: tuple[int, ...] = (2, 2, 2, 4),
                 dtype: Any = np.float16, page_size: int = PAGE) -> None:
        self.page_size = page_size
        self.layout = "page_first"
        self.kv_buffer = np.zeros((slots, *token_shape), dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[index:index + self.page_size]
        return page.reshape(-1) if flat else page

    def set_from_flat_data_page(self, index: int, data: Any) -> None:
        self.kv_buffer[index:index + self.page_size] = data.reshape(
            self.kv_buffer[index:index + self.page_size].shape)

    def get_dummy_flat_data_page(self) -> Any:
        return np.zeros(self.kv_buffer[:self.page_size].size, dtype=self.kv_buffer.dtype)

    def page_bytes(self, index: int) -> bytes:
        return self.kv_buffer[index:index + self.page_size].tobytes()


def storage_config(tp_rank: int = 0, tp_size: int = 1, *, mla: bool = False, pp_rank: int = 0,
                   pp_size: int = 1, extra: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                           attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                           enable_storage_metrics=False, is_page_first_layout=True,
                           model_name="org/tiny", extra_config=extra)


def load_backend(extra: dict[str, Any], pool: Any, **config: Any) -> Any:
    """Replay SGLang's dynamic loading: import module_path, getattr class_name, construct with
    (storage_config, extra config dict), then register the host pool."""
    module = importlib.import_module(extra["module_path"])
    cls = getattr(module, extra["class_name"])
    backend = cls(storage_config(extra=extra, **config), extra)
    backend.register_mem_pool_host(pool)
    return backend


def sglang_page_names(tokens: list[int], page: int) -> list[str]:
    """SGLang's page names: sha256(previous digest || tokens as u32 little-endian), hex."""
    names: list[str] = []
    prior: str | None = None
    for start in range(0, len(tokens) - page + 1, page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[start:start + page]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        names.append(prior)
    return names


@pytest.fixture
def extra(tmp_path: Path) -> dict[str, Any]:
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
            "class_name": "KVTierHiCacheStorage",
            "tiers": ["dram://?capacity=4MiB", f"file://{tmp_path / 'pool'}"]}


TOKENS = [(31 * i + 3) % 5000 for i in range(6 * PAGE)]


def _fill(pool: FakeHostPool, starts: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for s in starts:
        pool.kv_buffer[s:s + PAGE] = rng.standard_normal(pool.kv_buffer[s:s + PAGE].shape)


def test_factory_loads_it_and_pages_round_trip(extra: dict[str, Any]) -> None:
    pool_a, pool_b = FakeHostPool(64), FakeHostPool(64)
    a = load_backend(extra, pool_a)
    names = sglang_page_names(TOKENS, PAGE)
    starts_a = [8, 20, 0, 44, 12, 32]
    _fill(pool_a, starts_a, 1)
    host_a = np.concatenate([np.arange(s, s + PAGE) for s in starts_a])
    assert a.batch_exists(names) == 0
    assert a.batch_set_v1(names, host_a) == [True] * 6
    a.close()

    b = load_backend(extra, pool_b)
    try:
        assert b.batch_exists(names) == 6
        assert b.batch_exists([*names[:3], "ff" * 32, names[4]]) == 3
        starts_b = [40, 4, 16, 28, 52, 56]
        host_b = np.concatenate([np.arange(s, s + PAGE) for s in starts_b])
        missing = "ab" * 32
        got = b.batch_get_v1([*names[:5], missing], host_b)
        assert got == [True] * 5 + [False]
        for sa, sb in zip(starts_a[:5], starts_b[:5], strict=True):
            assert pool_b.page_bytes(sb) == pool_a.page_bytes(sa)
        assert b.exists(names[0]) and not b.exists(missing)
        copy = b.get(names[1])
        assert copy.tobytes() == pool_a.page_bytes(starts_a[1])
        assert b.get(missing) is None
    finally:
        b.close()


def test_set_skips_keys_already_present(extra: dict[str, Any]) -> None:
    pool = FakeHostPool(64)
    backend = load_backend(extra, pool)
    try:
        names = sglang_page_names(TOKENS, PAGE)
        _fill(pool, [0, 4, 8], 2)
        assert backend.batch_set_v1(names[:2], np.arange(0, 8)) == [True, True]
        puts = backend.store.stats()["puts"]
        assert backend.batch_set_v1(names[:3], np.arange(0, 12)) == [True] * 3
        assert backend.store.stats()["puts"] == puts + 1  # only the new page was written
    finally:
        backend.close()


def test_never_none_when_the_pool_fails(extra: dict[str, Any]) -> None:
    backend = load_backend(extra, FakeHostPool(16))
    names = sglang_page_names(TOKENS, PAGE)[:2]
    backend.close()  # every call now fails inside the backend
    assert backend.batch_exists(names) == 0
    assert backend.batch_get_v1(names, np.arange(0, 8)) == [False, False]
    assert backend.batch_set_v1(names, np.arange(0, 8)) == [False, False]
    assert backend.batch_get(names) == [None, None]
    assert backend.batch_set(names, [np.zeros(4), np.zeros(4)]) is False
    assert backend.batch_get_v1([], np.arange(0)) == []


def test_rank_suffixes_keep_shards_apart(extra: dict[str, Any]) -> None:
    names = sglang_page_names(TOKENS, PAGE)[:2]
    pool = FakeHostPool(16)
    _fill(pool, [0, 4], 3)
    writer = load_backend(extra, pool, tp_rank=0, tp_size=2)
    writer.batch_set_v1(names, np.arange(0, 8))
    writer.close()
    for config, seen in [({"tp_rank": 0, "tp_size": 2}, 2), ({"tp_rank": 1, "tp_size": 2}, 0),
                         ({"tp_rank": 0, "tp_size": 2, "pp_rank": 1, "pp_size": 2}, 0)]:
        reader = load_backend(extra, FakeHostPool(16), **config)
        try:
            assert reader.batch_exists(names) == seen, config
        finally:
            reader.close()
    # MLA ranks hold identical pages: one copy serves every rank.
    mla = load_backend(extra, pool, tp_rank=1, tp_size=2, mla=True)
    mla.batch_set_v1(names, np.arange(0, 8))
    mla.close()
    other = load_backend(extra, FakeHostPool(16), tp_rank=0, tp_size=2, mla=True)
    try:
        assert other.batch_exists(names) == 2
    finally:
        other.close()


def test_bad_extra_config_is_refused(extra: dict[str, Any]) -> None:
    for bad, match in [({"tiers": []}, "tiers"), ({"bogus": 1}, "bogus"),
                       ({"timeout_s": 0}, "timeout_s")]:
        with pytest.raises(ConfigError, match=match):
            load_backend({**extra, **bad}, FakeHostPool(8))


def test_is_a_real_hicache_storage_when_sglang_imports() -> None:
    try:
        module = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError:
        assert not sglang_available()
        assert KVTierHiCacheStorage.__mro__[1] is object
        return
    assert sglang_available() and issubclass(KVTierHiCacheStorage, module.HiCacheStorage)


# ------------------------------------------------------------------------ one keyspace
def test_one_keyspace_for_vllm_and_sglang(tmp_path: Path) -> None:
    """Same model, dtype, layout tag and page size: a block either engine saved is found (and
    loaded byte for byte) by the other. vLLM uses key_scheme="page-sha256" for this."""
    tiers = ["dram://?capacity=4MiB", f"file://{tmp_path / 'pool'}"]
    namespace = {"model": "tiny", "layout": "paged-flat-v1"}
    vllm_a = FakeEngine({"tiers": tiers, "key_scheme": "page-sha256", **namespace})
    prompt = TOKENS[:22]
    vllm_a.prefill(Request("v-1", prompt), [3, 1, 4, 5, 9, 2])
    vllm_bytes = [vllm_a.block_bytes(b) for b in [3, 1, 4, 5, 9]]
    vllm_a.close()
    assert BLOCK == PAGE

    # A page of this pool has the byte size of one vLLM block (320 bytes).
    pool = FakeHostPool(64, token_shape=(80,), dtype=np.uint8)
    sgl_extra = {"module_path": "kvtier.integrations.sglang",
                 "class_name": "KVTierHiCacheStorage", "tiers": tiers, "dtype": "float16",
                 **namespace}
    sgl = load_backend(sgl_extra, pool)
    try:
        names = sglang_page_names(prompt, PAGE)
        assert sgl.batch_exists(names) == 5
        assert sgl.batch_get_v1(names, np.arange(0, 5 * PAGE)) == [True] * 5
        assert [pool.page_bytes(i * PAGE) for i in range(5)] == vllm_bytes
        # And the other way: pages SGLang saved are found by vLLM's lookup.
        other = TOKENS[2:24]
        pool.kv_buffer[:] = np.arange(pool.kv_buffer.size, dtype=np.uint8).reshape(
            pool.kv_buffer.shape)
        assert sgl.batch_set_v1(sglang_page_names(other, PAGE), np.arange(0, 5 * PAGE)) == \
            [True] * 5
    finally:
        sgl.close()
    vllm_b = FakeEngine({"tiers": tiers, "key_scheme": "page-sha256", **namespace})
    try:
        ext, _, errors = vllm_b.prefill(Request("v-2", other), [10, 11, 12, 13, 14, 15])
        assert ext == 5 * BLOCK and errors == set()
        assert vllm_b.block_bytes(10) == pool.page_bytes(0)
    finally:
        vllm_b.close()


def test_default_layouts_keep_the_engines_apart(tmp_path: Path) -> None:
    tiers = [f"file://{tmp_path / 'pool'}"]
    vllm_a = FakeEngine({"tiers": tiers, "key_scheme": "page-sha256", "model": "tiny"})
    prompt = TOKENS[:22]
    vllm_a.prefill(Request("v-1", prompt), [0, 1, 2, 3, 4, 5])
    vllm_a.close()
    sgl = load_backend({"module_path": "kvtier.integrations.sglang",
                        "class_name": "KVTierHiCacheStorage", "tiers": tiers, "model": "tiny",
                        "dtype": "float16"}, FakeHostPool(32))
    try:
        assert sgl.batch_exists(sglang_page_names(prompt, PAGE)) == 0
    finally:
        sgl.close()


class StuckContainsTier(DRAMTier):
    """A DRAM tier whose presence checks never answer (a pool that hangs); ``waiting``
    counts the checks still running."""

    scheme = "stuckcontains"
    waiting = 0

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        type(self).waiting += 1
        try:
            await asyncio.Event().wait()
        finally:
            type(self).waiting -= 1
        raise AssertionError("unreachable")


def test_a_set_that_gave_up_leaves_no_check_running(
        extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``batch_set_v1`` against a pool whose checks hang: each call gives up after
    ``timeout_s`` and its check is cancelled, instead of piling up behind the pool."""
    monkeypatch.setitem(registry._registered, StuckContainsTier.scheme, StuckContainsTier)
    extra = {**extra, "tiers": ["stuckcontains://"], "timeout_s": 0.1,
             "store_options": {"close_timeout": 1.0}}
    pool = FakeHostPool(64)
    backend = load_backend(extra, pool)
    try:
        names = sglang_page_names(TOKENS, PAGE)
        for _ in range(3):
            backend.batch_set_v1(names[:2], np.arange(0, 8))
        deadline = time.monotonic() + 5
        while StuckContainsTier.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert StuckContainsTier.waiting == 0
    finally:
        backend.close()
