"""``benchmarks/bench_engine.py`` without vLLM: trace scaling, output checks, same-repeat
ratios, tables, and the skips that name what is missing. (The lane runs it in real vLLM.)"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_engine


def _row(config: str, request: str, ttft: float, repeat: int = 0, cached: int = 0,
         output: list[int] | None = None) -> dict[str, Any]:
    return {"workload": "one-prompt", "repeat": repeat, "config": config, "request": request,
            "ttft_s": ttft, "prompt_tokens": 2048, "cached_tokens": cached,
            "prefilled_tokens": 2048 - cached, "output": output or [1, 2], "wall_s": 10.0,
            "loadavg_1m_start": 1.5}


def test_trace_sessions_scale_blocks_and_keep_shared_prefixes(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl.gz"
    requests = [
        {"session": "a", "agent": None, "input_length": 1100, "hash_ids": [1, 2, 3]},
        {"session": "b", "agent": "sub", "input_length": 600, "hash_ids": [9, 10]},
        {"session": "a", "agent": None, "input_length": 1300, "hash_ids": [1, 2, 4]},
        {"session": "a", "agent": None, "input_length": 1536, "hash_ids": [1, 2, 5]},
        {"session": "c", "agent": None, "input_length": 99_000, "hash_ids": [7]},
    ]
    with gzip.open(trace, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in requests)
    sessions = bench_engine.trace_sessions(trace, count=5, turns=3, block_tokens=128,
                                           max_tokens=1000)
    assert len(sessions) == 1  # "b" is a sub-agent; "c" does not fit
    turns = sessions[0]
    # 512-token blocks become 128 tokens; a trailing partial block is scaled too.
    assert [len(t) for t in turns] == [128 + 128 + 19, 128 + 128 + 69, 128 * 3]
    assert turns[0][:256] == turns[1][:256] == turns[2][:256]
    assert turns[0][256:] != turns[1][256:275]


def test_check_outputs_against_no_connector_then_writer() -> None:
    rows = [_row("none", "hit", 1.0, output=[5, 6]), _row("file", "hit", 0.2, output=[5, 6]),
            _row("peers", "hit", 0.2, output=[5, 7]),
            _row("redis", "writer", 1.0, output=[8]), _row("redis", "hit", 0.1, output=[8])]
    rows[-1]["repeat"] = rows[-2]["repeat"] = 1  # repeat 1 has no no-connector run
    bench_engine.check_outputs(rows)
    assert [r["identical"] for r in rows] == [True, True, False, None, True]
    assert rows[-1]["reference"] == "writer (cold prefill)"


def test_ratios_pair_configurations_within_a_repeat() -> None:
    rows = [_row("none", "hit", 1.0, 0), _row("lmcache", "hit", 0.1, 0),
            _row("file", "hit", 0.2, 0),
            _row("none", "hit", 2.0, 1), _row("lmcache", "hit", 0.1, 1),
            _row("file", "hit", 0.1, 1)]
    assert bench_engine.ratio_median(rows, "file", "none", "hit") == pytest.approx(0.125)
    assert bench_engine.ratio_median(rows, "file", "lmcache", "hit") == pytest.approx(1.5)
    assert bench_engine.ratio_median(rows, "file", "example", "hit") is None
    assert bench_engine.delta_median(rows, "file", "hit") == pytest.approx(-1350.0)


def test_overhead_deltas_take_each_repeats_median_sample() -> None:
    rows = [_row("none", "miss", t, 0) for t in (0.70, 0.60, 0.65)] + \
        [_row("file", "miss", t, 0) for t in (0.90, 0.66, 0.67)] + \
        [_row("none", "miss", 0.5, 1), _row("file", "miss", 0.51, 1)]
    for i, r in enumerate(rows):
        r["connector_ms"] = float(i) if r["config"] == "file" else None
    # Repeat 0: median 0.67 - 0.65; repeat 1: 0.51 - 0.50; the median of the two deltas.
    assert bench_engine.delta_median(rows, "file", "miss") == pytest.approx(15.0)
    assert bench_engine.connector_ms(rows, "file", "miss") == pytest.approx(4.5)
    assert bench_engine.connector_ms(rows, "none", "miss") is None


def test_hook_log_sums_each_hook_within_a_window(tmp_path: Path) -> None:
    from benchmarks.engine_hooks import HookLog

    log = HookLog(str(tmp_path / "engine.hooks"))
    (tmp_path / "engine.hooks.11").write_text("10.0 wait_for_save 1.5\n20.0 save_kv_layer 9\n")
    scheduler = tmp_path / "engine.hooks.12"
    scheduler.write_text("10.5 get_num_new_matched_tokens 2.25\n10.7 wait_for_save 0.5\n"
                         "10.9 get_finished 0.")  # a line still being written
    assert log.window(9.0, 11.0) == {"wait_for_save": 2.0, "get_num_new_matched_tokens": 2.25}
    with open(scheduler, "a") as fh:
        fh.write("1\n")
    assert log.window(10.8, 21.0) == {"get_finished": 0.1, "save_kv_layer": 9.0}
    assert log.window(21.0, 30.0) == {}


def test_one_prompt_table_lists_each_configuration() -> None:
    rows = []
    for config, ttft in (("none", 1.0), ("lmcache", 0.1), ("file", 0.2)):
        for request in ("hit", "local", "miss"):
            rows.append(_row(config, request, ttft, cached=2016 if config != "none" else 0))
    bench_engine.check_outputs(rows)
    lines = bench_engine.one_prompt_table(rows, ["none", "lmcache", "file"])
    assert len(lines) == 5
    file_line = lines[-1]
    assert file_line.startswith("kvtier dram+file://")
    assert "2016/2048" in file_line and "0.20x" in file_line and "2.00x" in file_line


def test_missing_vllm_and_lmcache_are_named(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    absent = str(tmp_path / "no-python")
    python, why = bench_engine.find_vllm_python(absent)
    assert python is None and "--vllm-python" in why and "absent" in why
    assert "--lmcache-python" in (bench_engine.lmcache_problem(None) or "")
    assert "does not exist" in (bench_engine.lmcache_problem(absent) or "")
    assert bench_engine.main(["--vllm-python", absent]) == 1
    assert "no Python with vLLM" in capsys.readouterr().out


def test_a_hook_calling_another_is_timed_once(tmp_path: Path) -> None:
    import threading

    from benchmarks.engine_hooks import HookLog, _timed, _Writer

    class Connector:
        def request_finished(self) -> str:
            return "inner"

        def request_finished_all_groups(self) -> str:
            return self.request_finished()

    connector = Connector()
    writer, depth = _Writer(str(tmp_path / "e.hooks")), threading.local()
    for name in ("request_finished", "request_finished_all_groups"):
        setattr(connector, name, _timed(getattr(connector, name), name, writer, depth))
    assert connector.request_finished_all_groups() == "inner"
    assert connector.request_finished() == "inner"
    times = HookLog(str(tmp_path / "e.hooks")).window(0, 1e12)
    assert set(times) == {"request_finished_all_groups", "request_finished"}
    assert len((tmp_path / f"e.hooks.{os.getpid()}").read_text().splitlines()) == 2


def _args(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    bench_engine.options(parser)
    return parser.parse_args(list(argv))


def test_kv_size_large_is_64_kib_per_token_and_256_mib_per_prompt() -> None:
    model, prompt, context = bench_engine.resolve_kv_size(_args("--kv-size", "large"))
    assert bench_engine.kv_bytes_per_token(model) == 64 << 10
    assert prompt == 4096 and prompt * bench_engine.kv_bytes_per_token(model) == 256 << 20
    assert context >= prompt + 2 * bench_engine.OUTPUT_TOKENS
    assert bench_engine.dram_for(model, prompt) == "dram://?capacity=1024MiB"
    small, prompt, _ = bench_engine.resolve_kv_size(_args())
    assert bench_engine.kv_bytes_per_token(small) == 8 << 10 and prompt == 2048
    assert bench_engine.dram_for(small, prompt) == "dram://?capacity=512MiB"
    # An explicit prompt length wins; one that does not fit the context is refused.
    assert bench_engine.resolve_kv_size(_args("--kv-size", "large",
                                              "--prompt-tokens", "512"))[1] == 512
    with pytest.raises(SystemExit, match="does not fit"):
        bench_engine.resolve_kv_size(_args("--prompt-tokens", "4096", "--max-model-len", "4096"))


def test_vllm_environment_is_the_default_unless_a_flag_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import engine_procs

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    engine_procs.set_vllm_env({})
    env = engine_procs.engine_env()
    assert not any(k.startswith("VLLM_CPU") for k in env)  # vLLM's defaults
    assert env["HF_HUB_OFFLINE"] == "1"
    asked = bench_engine.parse_vllm_env(["VLLM_CPU_NUM_OF_RESERVED_CPU=1"])
    engine_procs.set_vllm_env(asked)
    try:
        assert engine_procs.engine_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
        assert engine_procs.vllm_environment() == asked
    finally:
        engine_procs.set_vllm_env({})
    with pytest.raises(SystemExit, match="VLLM_NAME=VALUE"):
        bench_engine.parse_vllm_env(["OMP_NUM_THREADS=1"])
    lines = bench_engine.environment_lines([{**_row("local", "hit", 0.1), "vllm_env": {},
                                             "background_load": 2,
                                             "kv_bytes_per_token": 64 << 10}])
    assert lines[0] == "vLLM environment: none set (vLLM's defaults)"
    assert "HF_HUB_OFFLINE=1" in lines[1]
    assert "2 CPU-bound" in lines[2] and "64 KiB per token, 128 MiB per 2048-token" in lines[2]


def test_local_configs_use_the_daemon(tmp_path: Path) -> None:
    setup = bench_engine.Setup("python", None, tmp_path, {"local": "kv-bench"}, 4096)
    for config in ("local", "local2", "localc"):
        spec = setup.connector(config, tmp_path)
        # Each its own namespace: a repeat's prompt is the same for every configuration,
        # and one configuration's save on the shared daemon must not be the next one's hit
        # (the kv_consumer writer loaded the prompt local:// had saved: 4095 tokens cached).
        assert spec is not None
        assert spec["tiers"] == [f"local://kv-bench?timeout=5&namespace={config}"]
        assert spec["kv_role"] == ("kv_consumer" if config == "localc" else "kv_both")
    assert all(len(bench_engine.CONFIGS[c]) <= 22 for c in ("local2", "localc"))  # the column


def test_writer_table_compares_each_writer_with_the_consumer_writer() -> None:
    rows = [{"workload": "one-prompt", "request": "writer", "config": config, "repeat": rep,
             "ttft_s": ttft, "connector_ms": 1.0}
            for config, values in (("local", (1.1, 1.3)), ("localc", (1.0, 1.0)))
            for rep, ttft in enumerate(values)]
    lines = bench_engine.writer_table(rows, ["local", "localc"])
    assert lines[2].split()[-1] == "1.20x" and lines[3].split()[-1] == "1.00x"
