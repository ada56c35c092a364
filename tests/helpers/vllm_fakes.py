"""Small stand-ins for the objects vLLM passes a KV connector (no vLLM import).

They mirror the attributes ``KVTierConnector`` reads, as found in vLLM 0.32's
``KVConnectorBase_V1``, ``Scheduler``, ``SchedulerOutput`` and ``Request``. ``FakeEngine`` pairs a
scheduler-side and a worker-side connector over numpy paged buffers and replays one step the
way vLLM's scheduler and model runner call them.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvtier.integrations.vllm import KVTierConnector
from kvtier.integrations.vllm_plan import SchedulerPlanner

BLOCK = 4
NUM_BLOCKS = 32


class Role(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


def vllm_config(extra: dict[str, Any], *, tp_size: int = 1, kv_events: bool = True,
                kv_role: str = "kv_both") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role=kv_role),
        model_config=SimpleNamespace(model="/models/tiny", served_model_name="tiny",
                                     dtype="float16", max_model_len=32 * BLOCK),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=kv_events))


def kv_cache_config() -> Any:
    # page_size_bytes as vLLM's FullAttentionSpec has it: K and V of one block of one layer.
    spec = SimpleNamespace(num_kv_heads=2, head_size=4, block_size=BLOCK,
                           page_size_bytes=2 * BLOCK * 2 * 4 * 2)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=["layers.0.attn", "layers.1.attn"], kv_cache_spec=spec)])


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def block_hashes(self) -> list[bytes]:
        """vLLM-style chained hashes of the full blocks (sha256 of parent, tokens, salt)."""
        hashes: list[bytes] = []
        tokens = self.all_token_ids
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            h = hashlib.sha256(hashes[-1] if hashes else b"root")
            h.update(repr((tokens[start:start + BLOCK], self.cache_salt)).encode())
            hashes.append(h.digest())
        return hashes


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def new_step(req: Request, block_ids: list[int], computed: int, scheduled: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,),
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: scheduled})


def empty_step() -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={})


def cached_step(req: Request, new_block_ids: list[int] | None, computed: int, scheduled: int,
                *, resumed: bool = False) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req.request_id], resumed_req_ids={req.request_id} if resumed else set(),
            new_block_ids=[None if new_block_ids is None else (new_block_ids,)],
            num_computed_tokens=[computed]),
        num_scheduled_tokens={req.request_id: scheduled})


def kv_of(tokens: list[int], block_index: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """What a forward pass writes for a block: a function of the whole prefix (like real KV)."""
    prefix = np.asarray(tokens[:(block_index + 1) * BLOCK], dtype=np.int64).tobytes()
    seed = int.from_bytes(hashlib.blake2b(prefix, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def shared_tiers(folder: Path) -> dict[str, object]:
    """Connector settings: each engine has a private DRAM tier over a file:// tier in
    ``folder`` that all engines read."""
    return {"tiers": ["dram://?capacity=4MiB", f"file://{folder / 'pool'}"], "model": "tiny-test"}


def expected_block(tokens: list[int], block_index: int) -> bytes:
    """The bytes of block ``block_index`` as :meth:`FakeEngine.compute` writes them for
    ``tokens`` (what :meth:`FakeEngine.block_bytes` reads back)."""
    return (kv_of(tokens, block_index, (BLOCK, 2, 4), np.float16).tobytes()
            + kv_of(tokens, block_index, (2, BLOCK, 2, 4), np.float32).tobytes())


class FakeEngine:
    """A scheduler-side and a worker-side connector over numpy paged buffers."""

    def __init__(self, extra: dict[str, Any], *, kv_events: bool = True,
                 kv_role: str = "kv_both") -> None:
        cfg = vllm_config(extra, kv_events=kv_events, kv_role=kv_role)
        self.scheduler = KVTierConnector(cfg, Role.SCHEDULER, kv_cache_config())
        self.worker = KVTierConnector(cfg, Role.WORKER, kv_cache_config())
        # One layer with the block dimension first, one with K/V split ahead of it.
        self.kv = {"layers.0.attn": np.zeros((NUM_BLOCKS, BLOCK, 2, 4), np.float16),
                   "layers.1.attn": np.zeros((2, NUM_BLOCKS, BLOCK, 2, 4), np.float32)}
        self.worker.register_kv_caches(self.kv)
        self.load_errors: set[int] = set()

    def planner_on_a_set_clock(self, start: float = 100.0) -> tuple[SchedulerPlanner, list[float]]:
        """The scheduler's planner, its clock made to read ``now[0]`` of the list returned
        (a test moves time on by adding to it)."""
        planner = self.scheduler._planner
        assert planner is not None
        now = [start]
        planner.clock = lambda: now[0]
        return planner, now

    def block_bytes(self, block_id: int) -> bytes:
        return (self.kv["layers.0.attn"][block_id].tobytes()
                + self.kv["layers.1.attn"][:, block_id].tobytes())

    def compute(self, tokens: list[int], block_index: int, block_id: int) -> None:
        self.kv["layers.0.attn"][block_id] = kv_of(tokens, block_index, (BLOCK, 2, 4),
                                                   np.float16)
        self.kv["layers.1.attn"][:, block_id] = kv_of(tokens, block_index, (2, BLOCK, 2, 4),
                                                      np.float32)

    def run_step(self, output: Any) -> Any:
        meta = self.scheduler.build_connector_meta(output)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        return meta

    def finish_step(self, req: Request, block_ids: list[int], first_computed: int,
                    upto: int) -> tuple[set[str] | None, set[int]]:
        """The forward pass computes blocks ``first_computed..`` of the request, then saves."""
        for b in range(first_computed, min(upto, len(req.all_token_ids)) // BLOCK):
            self.compute(req.all_token_ids, b, block_ids[b])
        self.worker.wait_for_save()
        _, recving = self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        self.scheduler.update_connector_output(SimpleNamespace(
            invalid_block_ids=errors, finished_recving=recving,
            kv_connector_worker_meta=self.worker.build_connector_worker_meta()))
        self.worker.clear_connector_metadata()
        return recving, errors

    def prefill(self, req: Request, block_ids: list[int], local_computed: int = 0
                ) -> tuple[int, bool, set[int]]:
        """Schedule a new request the way vLLM does; return (external tokens, async, errors)."""
        ext, load_async = self.scheduler.get_num_new_matched_tokens(req, local_computed)
        self.scheduler.update_state_after_alloc(req, Blocks(block_ids), ext)
        computed = local_computed + ext
        errors: set[int] = set()
        if load_async:
            # vLLM keeps the request waiting (WAITING_FOR_REMOTE_KVS) until get_finished says so.
            # It is not scheduled, but each step's metadata carries its load.
            errors = self.wait_for_async_load(req)
            output = new_step(req, block_ids, computed, len(req.prompt_token_ids) - computed)
        else:
            output = new_step(req, block_ids, computed, len(req.prompt_token_ids) - computed)
        self.run_step(output)
        _, more = self.finish_step(req, block_ids, computed // BLOCK, len(req.prompt_token_ids))
        return ext, load_async, errors | more

    def wait_for_async_load(self, req: Request) -> set[int]:
        """Run empty steps until the worker reports the request's asynchronous load done."""
        errors: set[int] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.run_step(empty_step())
            recving, more = self.finish_step(req, [], 0, 0)
            errors |= more
            if recving and req.request_id in recving:
                return errors
            time.sleep(0.002)
        raise AssertionError("async load never finished")

    def finish(self, req: Request) -> set[str]:
        """Finish the request the way vLLM does; return the requests the worker reported."""
        delay, _ = self.scheduler.request_finished(req, [])
        if not delay:
            return set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sending, _ = self.worker.get_finished({req.request_id})
            if sending:
                self.scheduler.update_connector_output(SimpleNamespace(
                    finished_sending=sending, invalid_block_ids=set(),
                    kv_connector_worker_meta=self.worker.build_connector_worker_meta()))
                return sending
            time.sleep(0.002)
        raise AssertionError("saves never finished")

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
