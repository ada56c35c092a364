"""Settings, keys and the scheduler-side plan of :class:`~kvtier.integrations.vllm.KVTierConnector`.

Nothing here imports vLLM: the scheduler side reads only the attributes vLLM passes (a
``Request``'s ``request_id``, ``prompt_token_ids``, ``all_token_ids``, ``cache_salt``,
``lora_request``, ``mm_features``; a ``SchedulerOutput``'s ``scheduled_new_reqs``,
``scheduled_cached_reqs`` and ``num_scheduled_tokens``), so tests drive it with small fakes.

The plan for each step is a :class:`KVTierMetadata` the worker side executes: which engine
blocks to fill from kvtier (loads) and which to copy into kvtier (saves), each with the token
ids that name them. Workers hash those tokens in their own namespace (their TP rank).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.errors import ConfigError
from kvtier.integrations.miss_log import LookupStore, MissLog
from kvtier.integrations.vllm_events import ConnectorEvents
from kvtier.keys import KEY_DIGEST_BYTES, KeyNamespace, prefix_keys
from kvtier.misses import MissReason

__all__ = ["BlockPlan", "ConnectorSettings", "KVTierMetadata", "SchedulerPlanner",
           "page_hash_keys", "plan_keys"]

log = logging.getLogger("kvtier.integrations.vllm")

# Schemes whose data lives in one process (or behind a lock one process holds): the
# scheduler process cannot see what the worker process put there.
PRIVATE_SCHEMES = frozenset({"dram", "hbm", "lmdb", "memory"})
KeyScheme = Literal["prefix", "page-sha256"]
_MM_TOKEN_BASE = 1 << 62  # substituted multimodal tokens sit above any vocabulary id
#: Seconds a lookup's answer serves the same waiting request again (see _Lookup).
LOOKUP_REUSE_S = 0.5
#: Seconds a block whose load failed is not promised again, although a tier still lists it
#: (a daemon that hung, a lease that expired): the next ask would fail the same way.
LOAD_FAILED_S = 30.0


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of the connector, validated.

    Keys: ``tiers`` (required list of tier URLs, opened by each worker), ``scheduler_tiers``
    (tiers the scheduler process opens for lookups; default: those of ``tiers`` that other
    processes can read, i.e. not ``dram``/``hbm``/``lmdb``/``memory``), ``model``, ``layout``
    and ``salt`` (namespace overrides), ``key_scheme`` (``"prefix"``: :func:`kvtier.prefix_keys`;
    ``"page-sha256"``: SGLang's page hashes, to share a pool with SGLang), ``lookup_timeout_s``
    (bound on the scheduler's lookup, default 0.1), ``io_timeout_s`` (worker loads, default 30),
    ``async_load`` (``"auto"``: asynchronous when the hit came from ``scheduler_tiers`` and
    the engine has other requests whose steps the load can overlap; ``"always"``;
    ``"never"``), ``index_blocks`` (keys of blocks this engine saved that the scheduler
    remembers, default 65536), ``event_buffer`` (KV events ``take_events()`` holds between two
    calls, oldest dropped past it; 0 turns events off; default 10000), ``staging_bytes``
    (bytes of each of the two host staging areas, for loads and for saves, each worker faults
    in at start and reuses: one request of ``max_model_len`` tokens, capped at this; default
    256 MiB; 0 allocates per transfer), ``thread_cpus`` (``"spare"``: on a worker that vLLM
    pinned to its compute cores, as its CPU backend does, the save gather runs on the
    engine's other CPUs and the store's thread on those and the worker's own, see
    :mod:`kvtier.integrations.cpu_affinity`; ``"inherit"``: both share the worker's CPUs;
    default ``"spare"``) and ``store_options`` (passed to
    :class:`~kvtier.BlockingStore`).
    """

    tiers: tuple[str, ...]
    scheduler_tiers: tuple[str, ...]
    model: str | None = None
    layout: str | None = None
    salt: str = ""
    key_scheme: KeyScheme = "prefix"
    lookup_timeout_s: float = 0.1
    io_timeout_s: float = 30.0
    async_load: Literal["auto", "always", "never"] = "auto"
    index_blocks: int = 65536
    event_buffer: int = 10_000
    staging_bytes: int = 256 << 20
    thread_cpus: Literal["spare", "inherit"] = "spare"
    store_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate ``kv_connector_extra_config``; a bad value raises :class:`ConfigError`."""
        extra = dict(extra or {})
        known = {"tiers", "scheduler_tiers", "model", "layout", "salt", "key_scheme",
                 "lookup_timeout_s", "io_timeout_s", "async_load", "index_blocks",
                 "event_buffer", "staging_bytes", "thread_cpus", "store_options"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        tiers = extra.get("tiers")
        if (not isinstance(tiers, list | tuple) or not tiers
                or not all(isinstance(t, str) for t in tiers)):
            raise ConfigError('kv_connector_extra_config["tiers"]: expected a non-empty list '
                              "of tier URL strings")
        sched = extra.get("scheduler_tiers")
        if sched is None:
            sched = [t for t in tiers if t.split("://", 1)[0].lower() not in PRIVATE_SCHEMES]
        elif not isinstance(sched, list | tuple) or not all(isinstance(t, str) for t in sched):
            raise ConfigError('kv_connector_extra_config["scheduler_tiers"]: expected a list '
                              "of tier URL strings")
        for name in ("model", "layout", "salt"):
            if extra.get(name) is not None and not isinstance(extra[name], str):
                raise ConfigError(f'kv_connector_extra_config["{name}"]: expected a string')
        if extra.get("key_scheme", "prefix") not in ("prefix", "page-sha256"):
            raise ConfigError('kv_connector_extra_config["key_scheme"]: expected "prefix" or '
                              '"page-sha256"')
        if extra.get("async_load", "auto") not in ("auto", "always", "never"):
            raise ConfigError('kv_connector_extra_config["async_load"]: expected "auto", '
                              '"always" or "never"')
        for name in ("lookup_timeout_s", "io_timeout_s"):
            value = extra.get(name, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f'kv_connector_extra_config["{name}"]: expected seconds > 0')
        index_blocks = extra.get("index_blocks", 65536)
        if isinstance(index_blocks, bool) or not isinstance(index_blocks, int) or index_blocks < 0:
            raise ConfigError('kv_connector_extra_config["index_blocks"]: expected an int >= 0')
        event_buffer = extra.get("event_buffer", 10_000)
        if isinstance(event_buffer, bool) or not isinstance(event_buffer, int) or event_buffer < 0:
            raise ConfigError('kv_connector_extra_config["event_buffer"]: expected an int >= 0')
        staging_bytes = extra.get("staging_bytes", 256 << 20)
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) \
                or staging_bytes < 0:
            raise ConfigError('kv_connector_extra_config["staging_bytes"]: expected an int '
                              ">= 0 (bytes)")
        if extra.get("thread_cpus", "spare") not in ("spare", "inherit"):
            raise ConfigError('kv_connector_extra_config["thread_cpus"]: expected "spare" or '
                              '"inherit"')
        options = extra.get("store_options", {})
        if not isinstance(options, Mapping):
            raise ConfigError('kv_connector_extra_config["store_options"]: expected a mapping')
        return cls(tiers=tuple(tiers), scheduler_tiers=tuple(sched), model=extra.get("model"),
                   layout=extra.get("layout"), salt=extra.get("salt") or "",
                   key_scheme=extra.get("key_scheme", "prefix"),
                   lookup_timeout_s=float(extra.get("lookup_timeout_s", 0.1)),
                   io_timeout_s=float(extra.get("io_timeout_s", 30.0)),
                   async_load=extra.get("async_load", "auto"), index_blocks=index_blocks,
                   event_buffer=event_buffer, staging_bytes=staging_bytes,
                   thread_cpus=extra.get("thread_cpus", "spare"), store_options=dict(options))


def page_hash_keys(tokens: Sequence[int], page_size: int, namespace: KeyNamespace
                   ) -> list[bytes]:
    """Keys of SGLang's page hashes: ``H(namespace root || sha256 page chain)``.

    SGLang names page ``i`` ``sha256(page_{i-1} || tokens of page i as u32 LE)`` (hex); the
    SGLang adapter receives those names, the vLLM adapter with ``key_scheme="page-sha256"``
    computes them from token ids. Both map a name to a kvtier key with :func:`engine_page_key`.
    """
    keys: list[bytes] = []
    prior: bytes | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        for t in tokens[start:start + page_size]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.digest()
        keys.append(engine_page_key(namespace, prior.hex()))
    return keys


def engine_page_key(namespace: KeyNamespace, page_name: str) -> bytes:
    """The kvtier key of an engine-named page (e.g. an SGLang page hash) in ``namespace``."""
    h = hashlib.blake2b(namespace.root_key(), digest_size=KEY_DIGEST_BYTES,
                        person=b"kvtier-page")
    h.update(page_name.encode("utf-8"))
    return h.digest()


def request_hash_tokens(request: Any) -> tuple[list[int], str]:
    """Token ids that name a request's blocks, and the request's namespace salt.

    Multimodal placeholder tokens are replaced by values derived from the item's hash and
    position (above any vocabulary id), so two images never share a block while the text
    before them still does. ``cache_salt`` and the LoRA adapter go into the salt.
    """
    tokens = list(map(int, request.all_token_ids))
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        seed = hashlib.blake2b(str(feature.identifier).encode(), digest_size=8).digest()
        base = int.from_bytes(seed, "little") & ((1 << 61) - 1)
        for j in range(pos.offset, min(pos.offset + pos.length, len(tokens))):
            tokens[j] = _MM_TOKEN_BASE | ((base + j - pos.offset) & ((1 << 61) - 1))
    parts = []
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}")
    return tokens, ";".join(parts)


@dataclass
class BlockPlan:
    """Blocks of one request to move this step: ``block_ids[i]`` is block ``first + i``."""

    req_id: str
    tokens: list[int]  # hash tokens up to the last block named here
    salt: str
    first: int
    block_ids: list[int]
    load_async: bool = False
    save_id: int = -1  # names a save in the workers' reports (KV events); -1: not tracked
    # The keys of block_ids as the scheduler made them, when the engine has one shard (TP 1,
    # PP 1): the worker's are the same, and it takes them instead of hashing the tokens again
    # (2 ms for 256 blocks on a loaded host, inside wait_for_save and start_load_kv).
    keys: list[bytes] | None = None


@dataclass
class KVTierMetadata:
    """One step's plan, from the scheduler to every worker (picklable)."""

    loads: list[BlockPlan] = field(default_factory=list)
    saves: list[BlockPlan] = field(default_factory=list)
    #: Blocks vLLM may write from this step on: those it gave requests this step (new and
    #: resumed requests' block tables, blocks added to running ones) and those loads fill.
    #: ``None``: not known (a worker then waits for every save copying out of the pages).
    fresh_blocks: list[int] | None = None


@dataclass
class _Lookup:
    """A request's last lookup. vLLM asks again at every step for a request it could not
    schedule (no free KV blocks): within :data:`LOOKUP_REUSE_S` of the last lookup, for the
    same local hit, the answer is reused without I/O on the scheduler's thread."""

    hit: int  # leading blocks found
    slow: bool  # found through the store, not only the index
    keys: list[bytes]  # the prompt's rank-0 keys
    computed: int  # vLLM's own (local) hit the answer was for
    at: float  # monotonic time of the lookup
    load_async: bool = False  # what vLLM was last told


@dataclass
class _Request:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks known to be in kvtier (saved, loaded or found)
    planned_saves: bool = False


class KeyMaker:
    """Makes a request's keys in one shard's namespace (``salt`` is per request).

    A shard is a (TP rank, PP stage) pair: each stores its own slice of every block, so each
    has its own keys (the TP rank in :class:`KeyNamespace`, the PP stage in its layout).
    """

    def __init__(self, settings: ConnectorSettings, base: KeyNamespace, block_size: int,
                 pp_size: int = 1) -> None:
        self.settings = settings
        self.base = base
        self.block_size = block_size
        self.shards = [(tp, pp) for pp in range(pp_size) for tp in range(base.tp_size)]
        self.pp_size = pp_size

    def namespace(self, salt: str, shard: tuple[int, int] = (0, 0)) -> KeyNamespace:
        combined = ";".join(s for s in (self.settings.salt, salt) if s)
        layout = self.base.layout if self.pp_size == 1 else \
            f"{self.base.layout}/pp{shard[1]}of{self.pp_size}"
        return KeyNamespace(model=self.base.model, dtype=self.base.dtype, layout=layout,
                            tp_rank=shard[0], tp_size=self.base.tp_size, salt=combined)

    def keys(self, tokens: Sequence[int], salt: str, n_blocks: int,
             shard: tuple[int, int] = (0, 0)) -> list[bytes]:
        ns = self.namespace(salt, shard)
        head = tokens[:n_blocks * self.block_size]
        if self.settings.key_scheme == "page-sha256":
            return page_hash_keys(head, self.block_size, ns)
        return prefix_keys(list(head), self.block_size, ns)


def plan_keys(plan: BlockPlan, keys: KeyMaker, shard: tuple[int, int]) -> list[bytes]:
    """The keys of ``plan``'s blocks for ``shard``: the plan's own when it carries them (one
    shard), else made from its tokens."""
    if plan.keys is not None and shard == (0, 0) and len(plan.keys) == len(plan.block_ids):
        return plan.keys
    n = plan.first + len(plan.block_ids)
    return keys.keys(plan.tokens, plan.salt, n, shard)[plan.first:]


class SchedulerPlanner:
    """The scheduler side: answers lookups and plans each step's loads and saves.

    Lookups ask ``store`` (the tiers other processes can read) and an in-memory index of the
    blocks this engine's workers saved or loaded (held in their private tiers). Under
    ``async_load="auto"`` a block found only through ``store`` loads asynchronously while the
    engine has other requests: their steps go on during the load. With none, the load is
    synchronous: the engine would only spin empty steps, whose Python work competes with the
    load for the GIL (a 16 MiB peer load took 42 ms asynchronously and 29 ms synchronously in
    the benchmark). With ``saves`` false (vLLM's ``kv_role: kv_consumer``) it plans loads
    only. Called from the scheduler thread only.
    """

    def __init__(self, settings: ConnectorSettings, keys: KeyMaker,
                 store: LookupStore | None, events: ConnectorEvents | None = None,
                 clock: Callable[[], float] = time.monotonic, *, saves: bool = True) -> None:
        self.settings = settings
        self.saves = saves
        self.clock = clock
        self.keys = keys
        self.store = store
        self.events = events
        self.block_size = keys.block_size
        self._index: OrderedDict[bytes, None] = OrderedDict()
        # vLLM block hash -> rank-0 key of blocks put in the index: a step that completes
        # blocks vLLM hashed already tells from these whether they are stored, without keying
        # the whole prompt (0.3-0.9 ms for 4,096 tokens, on a request vLLM's cache serves).
        self._by_hash: OrderedDict[Any, bytes] = OrderedDict()
        self._requests: dict[str, _Request] = {}
        self._pending_loads: dict[str, BlockPlan] = {}
        self._load_hashes: dict[str, list[bytes]] = {}  # vLLM block hashes of planned loads
        self._load_keys: dict[str, list[bytes]] = {}  # their rank-0 keys
        # Block id -> (request, rank-0 key, vLLM block hash) of loads whose errors may still
        # come: this step's, and asynchronous ones until their request finished receiving.
        self._inflight: dict[int, tuple[str, bytes, bytes | None]] = {}
        self._async_loading: set[str] = set()
        self._lookups: dict[str, _Lookup] = {}  # by request id, until it is scheduled
        # Requests whose lookup was counted (in misses) since they last waited: asking again
        # for one request is one lookup in the figures, however often vLLM asks.
        self._counted: set[str] = set()
        self._failed: OrderedDict[bytes, float] = OrderedDict()  # rank-0 key -> until
        self.misses = MissLog(store, log)  # one summary line per interval

    # ---------------------------------------------------------------- index
    def _remember(self, keys: Sequence[bytes]) -> None:
        if self.settings.index_blocks == 0:
            return
        for key in keys:
            self._index[key] = None
            self._index.move_to_end(key)
        while len(self._index) > self.settings.index_blocks:
            self._index.popitem(last=False)

    def _note_hashes(self, request: Any, first: int, keys: Sequence[bytes]) -> None:
        """Map vLLM's hashes of blocks ``first..`` of ``request`` to their ``keys``."""
        if self.settings.index_blocks == 0:
            return
        hashes = list(getattr(request, "block_hashes", None) or ())[first:first + len(keys)]
        for block_hash, key in zip(hashes, keys, strict=False):
            self._by_hash[block_hash] = key
            self._by_hash.move_to_end(block_hash)
        while len(self._by_hash) > self.settings.index_blocks:
            self._by_hash.popitem(last=False)

    def _stored_by_hash(self, request: Any, first: int, full: int) -> bool:
        """Whether blocks ``first..full`` of ``request`` are in the index, known by vLLM's
        block hashes alone (``False`` when any is not known that way)."""
        hashes = getattr(request, "block_hashes", None) or ()
        if len(hashes) < full:
            return False
        for block_hash in hashes[first:full]:
            key = self._by_hash.get(block_hash)
            if key is None or key not in self._index:
                return False
        return True

    def _lookup(self, keys: list[bytes], salt: str, tokens: Sequence[int]) -> tuple[int, bool]:
        local = 0
        while local < len(keys) and keys[local] in self._index:
            local += 1
        shared = 0
        if self.store is not None and local < len(keys):
            n = len(keys)
            try:
                # Every shard must hold a block for vLLM to load it.
                shared = min(self.store.lookup_prefix(
                    self.keys.keys(tokens, salt, n, shard),
                    timeout=self.settings.lookup_timeout_s) for shard in self.keys.shards)
            except Exception as exc:  # a slow or failing pool is a miss, never a stall
                log.warning("kvtier lookup failed (%r); treating as a miss", exc)
                self.misses.note(MissReason.UNAVAILABLE)
                shared = 0
        hit = max(local, shared)
        while hit < len(keys) and keys[hit] in self._index:
            hit += 1
        if self._failed:
            hit = self._before_failed(keys, hit)
        slow = shared > local
        return hit, slow

    def _before_failed(self, keys: list[bytes], hit: int) -> int:
        """``hit`` cut at the first key whose load failed within :data:`LOAD_FAILED_S`."""
        now = self.clock()
        while self._failed and next(iter(self._failed.values())) <= now:
            self._failed.popitem(last=False)
        for i in range(hit):
            if keys[i] in self._failed:
                return i
        return hit

    # ---------------------------------------------------------------- vLLM hooks
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        prompt = request.prompt_token_ids or []
        # Never the whole prompt: vLLM must compute at least its last token. A prompt that
        # ends on a block boundary still loads its last block, claimed but for that token
        # (vLLM recomputes the token's KV over the loaded copy), so vLLM computes one token,
        # not a whole block as after its own prefix cache's hit; but not when vLLM's own
        # hit already covers every block before it: that load would spare vLLM fewer than a
        # block of tokens for a lease round trip, a block's copy and the keying of the whole
        # prompt (1.6 ms of start_load_kv and 0.7 ms of this hook in bench_engine's large
        # model, against a connector-less engine that computes those tokens too).
        n_blocks = len(prompt) // self.block_size
        limit = len(prompt) - 1
        if min(n_blocks * self.block_size, limit) - num_computed_tokens < self.block_size:
            if not n_blocks:
                self.misses.lookup(0, 0, MissReason.BELOW_THRESHOLD)
            return 0, False
        if self.settings.key_scheme == "page-sha256" and getattr(request, "mm_features", None):
            return 0, False  # SGLang's page names carry no multimodal content
        now = self.clock()
        last = self._lookups.get(request.request_id)
        if last is None or last.computed != num_computed_tokens \
                or now - last.at > LOOKUP_REUSE_S:
            tokens, salt = request_hash_tokens(request)
            keys = self.keys.keys(tokens, salt, n_blocks)
            hit, slow = self._lookup(keys, salt, tokens)
            if request.request_id not in self._counted:
                self._counted.add(request.request_id)
                self.misses.lookup(len(keys), hit)
            last = self._lookups[request.request_id] = _Lookup(hit, slow, keys,
                                                               num_computed_tokens, now)
        hit = last.hit
        external = min(hit * self.block_size, limit) - num_computed_tokens
        if external <= 0:
            return 0, False
        mode = self.settings.async_load
        others = any(r != request.request_id for r in self._requests)
        last.load_async = mode == "always" or (mode == "auto" and last.slow and others)
        return external, last.load_async

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, _Request(request))
        state.request = request
        self._counted.discard(request.request_id)
        last = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or last is None:
            return
        hit, keys, load_async = last.hit, last.keys, last.load_async
        first = hit - -(-num_external_tokens // self.block_size)  # blocks the claim touches
        tokens, salt = request_hash_tokens(request)
        self._pending_loads[request.request_id] = BlockPlan(
            request.request_id, tokens[:hit * self.block_size], salt, first,
            list(block_ids[first:hit]), load_async=load_async,
            keys=keys[first:hit] if len(self.keys.shards) == 1 else None)
        self._load_hashes[request.request_id] = list(
            getattr(request, "block_hashes", None) or ())[first:hit]
        self._load_keys[request.request_id] = keys[first:hit]
        state.saved = max(state.saved, hit)
        # The load promotes these blocks into the workers' top tier: the next lookup of this
        # prefix (after vLLM evicted it) is an index hit, with no I/O on this thread.
        self._remember(keys[first:hit])
        self._note_hashes(request, first, keys[first:hit])

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        fresh: list[int] = []
        meta = KVTierMetadata(loads=list(self._pending_loads.values()), fresh_blocks=fresh)
        self._pending_loads.clear()
        for plan in meta.loads:
            fresh += plan.block_ids
        self._inflight = {b: entry for b, entry in self._inflight.items()
                          if entry[0] in self._async_loading}
        for plan in meta.loads:
            keys = self._load_keys.pop(plan.req_id)
            hashes = self._load_hashes.pop(plan.req_id, [])
            for i, (block_id, key) in enumerate(zip(plan.block_ids, keys, strict=True)):
                self._inflight[block_id] = (plan.req_id, key,
                                            hashes[i] if i < len(hashes) else None)
            if plan.load_async:
                self._async_loading.add(plan.req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            fresh += new.block_ids[0]
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            state.saved = max(state.saved, new.num_computed_tokens // self.block_size)
            self._plan_save(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                fresh += new_ids[0]
            state = self._requests.get(req_id)
            if state is None:
                continue
            if req_id in cached.resumed_req_ids:  # preempted and back: a new block table
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_save(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KVTierMetadata, state: _Request, computed: int) -> None:
        # Most steps complete no new block (a decode step adds one token): decide that before
        # building the request's hash tokens (0.1-0.2 ms for 2,048 tokens, every step).
        full = min(computed, len(state.request.all_token_ids),
                   len(state.block_ids) * self.block_size) // self.block_size
        if full <= state.saved or not self.saves:
            return
        if self._stored_by_hash(state.request, state.saved, full):
            state.saved = full  # saved or loaded before (vLLM's cache served the rest)
            return
        tokens, salt = request_hash_tokens(state.request)
        if self.settings.key_scheme == "page-sha256" and getattr(state.request, "mm_features",
                                                                  None):
            return
        keys = self.keys.keys(tokens, salt, full)
        first = state.saved
        # Blocks this engine saved or loaded before (e.g. the last block of a prompt that
        # vLLM's prefix cache served but for its last token) are stored already: saving them
        # again would cost a copy and a write, and hold the request's blocks until it ends.
        while first < full and keys[first] in self._index:
            first += 1
        self._note_hashes(state.request, state.saved, keys[state.saved:first])
        state.saved = full
        if first == full:
            return
        save_id = -1 if self.events is None else \
            self.events.record_save(state.request, first, full)
        meta.saves.append(BlockPlan(state.request.request_id, tokens[:full * self.block_size],
                                    salt, first, state.block_ids[first:full], save_id=save_id,
                                    keys=keys[first:full] if len(self.keys.shards) == 1
                                    else None))
        self._remember(keys[first:])
        self._note_hashes(state.request, first, keys[first:full])
        state.planned_saves = True

    def load_errors(self, block_ids: Sequence[int]) -> None:
        """Forget blocks whose load failed (they vanished from the workers' tiers, or the
        tier holding them did not serve them in time), promise none of them again for
        :data:`LOAD_FAILED_S`, and announce them removed."""
        gone: list[bytes] = []
        until = self.clock() + LOAD_FAILED_S
        for block_id in block_ids:
            entry = self._inflight.pop(block_id, None)
            if entry is not None:
                self._index.pop(entry[1], None)
                self._failed[entry[1]] = until
                self._failed.move_to_end(entry[1])
                while len(self._failed) > max(self.settings.index_blocks, 1):
                    self._failed.popitem(last=False)
                if entry[2] is not None:
                    gone.append(entry[2])
        if self.events is not None:
            self.events.removed(gone)

    def loads_finished(self, req_ids: Sequence[str]) -> None:
        """Asynchronous loads of these requests are done (their errors were reported)."""
        self._async_loading.difference_update(req_ids)

    def request_finished(self, request_id: str) -> bool:
        """Forget the request; whether its workers have saves to report (see get_finished)."""
        state = self._requests.pop(request_id, None)
        self._lookups.pop(request_id, None)
        self._counted.discard(request_id)
        self._pending_loads.pop(request_id, None)
        self._load_hashes.pop(request_id, None)
        self._load_keys.pop(request_id, None)
        return state is not None and state.planned_saves
