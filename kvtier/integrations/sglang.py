"""SGLang HiCache L3 storage backend: ``KVTierHiCacheStorage`` (the ``dynamic`` backend).

::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"kvtier",
        "module_path":"kvtier.integrations.sglang","class_name":"KVTierHiCacheStorage",
        "tiers":["dram://?capacity=8GiB","peers://h1:7070,h2:7070?token=env:KVTIER_TOKEN"]}'

SGLang names each page with a chained SHA-256 of its tokens (hex); the backend maps a name to a
kvtier key in a namespace of model, KV dtype, layout tag, TP rank/size (omitted for MLA, whose
ranks hold identical pages) and PP stage, so shards never collide. Pages move between SGLang's
host memory pool and kvtier with ``get_many_into``/``put_many`` through a
:class:`~kvtier.BlockingStore` (SGLang calls storage from its own prefetch/backup threads).

This module imports without SGLang; when ``sglang.srt.mem_cache.hicache_storage`` imports, the
class derives from its ``HiCacheStorage``. See ``docs/integrations/sglang.md``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.blocking import BlockingStore
from kvtier.errors import ConfigError
from kvtier.integrations.vllm_plan import engine_page_key
from kvtier.keys import KeyNamespace

__all__ = ["KVTierHiCacheStorage", "sglang_available"]

log = logging.getLogger("kvtier.integrations.sglang")

_EXTRA_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "tiers", "model",
               "dtype", "layout", "salt", "store_options", "timeout_s"}


def _storage_bases() -> tuple[type[Any], ...]:
    try:
        module: Any = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError:
        return ()
    return (module.HiCacheStorage,)


_BASES = _storage_bases()


def sglang_available() -> bool:
    """Whether the backend derives from SGLang's real ``HiCacheStorage``."""
    return bool(_BASES)


def _is_torch(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "torch"


def _to_host_bytes(page: Any) -> npt.NDArray[np.uint8]:
    """A private flat ``uint8`` copy of one page (the host pool reuses its pages)."""
    if _is_torch(page):
        import torch

        flat: npt.NDArray[np.uint8] = page.detach().contiguous().reshape(-1).view(
            torch.uint8).cpu().numpy().copy()
        return flat
    return np.ascontiguousarray(page).reshape(-1).view(np.uint8).copy()


def _like(raw: npt.NDArray[np.uint8], like: Any) -> Any:
    """``raw`` reinterpreted with the dtype (and array type) of ``like``, without copying."""
    if _is_torch(like):
        import torch

        return torch.from_numpy(raw).view(like.dtype)
    return raw.view(like.dtype)


class KVTierHiCacheStorage(*_BASES):  # type: ignore[misc]
    """HiCache storage over a kvtier pool.

    Parameters
    ----------
    storage_config
        SGLang's ``HiCacheStorageConfig`` (``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``,
        ``is_mla_model``, ``is_page_first_layout``, ``model_name``, ``extra_config``).
    kwargs
        The extra-config dict (the ``dynamic`` factory passes it; defaults to
        ``storage_config.extra_config``). ``tiers`` (list of tier URLs) is required; optional
        ``model``, ``dtype``, ``layout``, ``salt`` (namespace), ``store_options`` (for
        :class:`~kvtier.BlockingStore`) and ``timeout_s`` (per call, default 30).

    Notes
    -----
    Every batch method returns a list (or an int for ``batch_exists``), never ``None``: a
    failing pool reads as misses and failed writes. Thread-safe (SGLang calls from several
    threads); pages are copied on save, so SGLang may reuse host pages once a call returns.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(kwargs if kwargs is not None else (storage_config.extra_config or {}))
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ConfigError(f"hicache extra config: unknown key(s) {', '.join(unknown)}")
        tiers = extra.get("tiers")
        if (not isinstance(tiers, list | tuple) or not tiers
                or not all(isinstance(t, str) for t in tiers)):
            raise ConfigError('hicache extra config "tiers": expected a non-empty list of tier '
                              "URL strings")
        timeout = extra.get("timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ConfigError('hicache extra config "timeout_s": expected seconds > 0')
        mla = bool(storage_config.is_mla_model)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        layout = extra.get("layout") or (
            f"sglang/{'mla' if mla else 'mha'}/"
            f"{'page_first' if storage_config.is_page_first_layout else 'layer_first'}")
        if pp_size > 1:
            layout += f"/pp{storage_config.pp_rank}of{pp_size}"
        model = extra.get("model") or storage_config.model_name or ""
        if not model:
            raise ConfigError('hicache extra config "model": required when SGLang passes no '
                              "model_name")
        self.namespace = KeyNamespace(
            model=model, dtype=str(extra.get("dtype", "")), layout=layout,
            tp_rank=0 if mla else int(storage_config.tp_rank),
            tp_size=1 if mla else int(storage_config.tp_size), salt=str(extra.get("salt", "")))
        options = {"write_policy": "write_through", **dict(extra.get("store_options") or {})}
        self.timeout_s = float(timeout)
        self.store = BlockingStore(list(tiers), timeout=self.timeout_s, **options)
        self.mem_pool_host: Any = None

    # ---------------------------------------------------------------- plumbing
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach SGLang's host KV pool (``page_size``, page get/set methods)."""
        self.mem_pool_host = mem_pool_host

    def _pool(self) -> Any:
        if self.mem_pool_host is None:
            raise RuntimeError("register_mem_pool_host was not called")
        return self.mem_pool_host

    def key(self, name: str) -> bytes:
        """The kvtier key of SGLang page ``name`` in this backend's namespace."""
        return engine_page_key(self.namespace, name)

    def _page_starts(self, host_indices: Any, n: int) -> list[int]:
        page = int(self._pool().page_size)
        return [int(host_indices[i * page]) for i in range(n)]

    # ---------------------------------------------------------------- presence
    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` kvtier holds (``lookup_prefix``)."""
        try:
            return self.store.lookup_prefix([self.key(k) for k in keys])
        except Exception as exc:
            log.warning("kvtier batch_exists failed (%r); reporting no hit", exc)
            return 0

    def exists(self, key: str) -> bool:
        try:
            return self.store.contains(self.key(key))
        except Exception as exc:
            log.warning("kvtier exists failed (%r)", exc)
            return False

    # ---------------------------------------------------------------- zero-copy v1
    def batch_get_v1(self, keys: Sequence[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Fill the host pages at ``host_indices`` from kvtier; ``False`` where missing."""
        pool = self._pool()
        if not keys:
            return []
        try:
            like = pool.get_dummy_flat_data_page()
            nbytes = int(like.numel() * like.element_size()) if _is_torch(like) else like.nbytes
            staging = [np.empty(nbytes, dtype=np.uint8) for _ in keys]
            hits = self.store.get_many_into([self.key(k) for k in keys], staging)
            for start, hit, raw in zip(self._page_starts(host_indices, len(keys)), hits,
                                       staging, strict=True):
                if hit:
                    pool.set_from_flat_data_page(start, _like(raw, like))
            return [bool(h) for h in hits]
        except Exception as exc:
            log.warning("kvtier batch_get_v1 failed (%r); reporting misses", exc)
            return [False] * len(keys)

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Copy the host pages at ``host_indices`` into kvtier, skipping keys already there."""
        pool = self._pool()
        if not keys:
            return []
        try:
            kv_keys = [self.key(k) for k in keys]
            # Bounded by timeout_s, and cancelled past it (checks never pile up behind a
            # slow pool); a tier that timed out reads as "not there", so the page is written.
            present = self.store.contains_many(kv_keys)
            starts = self._page_starts(host_indices, len(keys))
            items = [(key, _to_host_bytes(pool.get_data_page(start, flat=True)))
                     for key, start, there in zip(kv_keys, starts, present, strict=True)
                     if not there]
            if items:
                self.store.put_many(items)
            return [True] * len(keys)
        except Exception as exc:
            log.warning("kvtier batch_set_v1 failed (%r)", exc)
            return [False] * len(keys)

    # ---------------------------------------------------------------- copying API
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """One page as a flat array (or copied into ``target_location``); ``None`` on a miss."""
        result = self.batch_get([key], [target_location] if target_location is not None
                                else None)
        return result[0]

    def batch_get(self, keys: Sequence[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        try:
            blocks = self.store.get_many([self.key(k) for k in keys])
        except Exception as exc:
            log.warning("kvtier batch_get failed (%r)", exc)
            return [None] * len(keys)
        out: list[Any] = []
        for i, block in enumerate(blocks):
            if block is None:
                out.append(None)
                continue
            raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
            if target_locations is not None and target_locations[i] is not None:
                out.append(_copy_into(target_locations[i], raw))
            else:
                out.append(raw.copy())
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: Sequence[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        sources = values if values is not None else target_locations
        if sources is None or len(sources) != len(keys):
            return False
        try:
            self.store.put_many([(self.key(k), _to_host_bytes(v))
                                 for k, v in zip(keys, sources, strict=True)])
            return True
        except Exception as exc:
            log.warning("kvtier batch_set failed (%r)", exc)
            return False

    def close(self) -> None:
        """Flush and close the store (SGLang does not call this; servers may at shutdown)."""
        self.store.close()


def _copy_into(target: Any, raw: npt.NDArray[np.uint8]) -> Any:
    if _is_torch(target):
        target.reshape(-1).copy_(_like(raw.copy(), target))
    else:
        target.reshape(-1).view(np.uint8)[:] = raw
    return target

