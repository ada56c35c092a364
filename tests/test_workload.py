"""The synthetic agentic workload: deterministic, prefix-chained, sessions and sub-agents."""

from __future__ import annotations

import pytest

from kvtier.replay.trace import BLOCK_TOKENS
from kvtier.workload import WorkloadConfig, generate


def test_deterministic_and_ordered() -> None:
    cfg = WorkloadConfig(sessions=10, concurrency=4, seed=7)
    a, b = list(generate(cfg)), list(generate(cfg))
    assert a == b and len(a) > 30
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    assert list(generate(WorkloadConfig(sessions=10, concurrency=4, seed=8))) != a


def test_block_ids_are_prefix_chained() -> None:
    # Equal id at position i must mean an equal prefix 0..i, across every request.
    reqs = list(generate(WorkloadConfig(sessions=24, concurrency=8)))
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        for i, block in enumerate(r.hash_ids):
            prefix = tuple(r.hash_ids[:i])
            assert prefix_of.setdefault(block, prefix) == prefix
        full, partial = divmod(r.input_length, BLOCK_TOKENS)
        assert len(r.hash_ids) == full + (1 if partial else 0)


def test_sessions_share_system_prompts_and_subagents_branch() -> None:
    cfg = WorkloadConfig(sessions=30, concurrency=6, system_prompts=2, subagent_prob=0.5)
    reqs = list(generate(cfg))
    assert len({r.session for r in reqs}) == 30
    prompt_blocks = cfg.system_prompt_tokens // BLOCK_TOKENS
    heads = {tuple(r.hash_ids[:prompt_blocks]) for r in reqs}
    assert len(heads) == 2  # every session starts with one of the two system prompts
    subs = [r for r in reqs if r.agent is not None]
    assert subs
    for sub in subs:
        parents = [r for r in reqs if r.session == sub.session and r.agent is None
                   and r.timestamp <= sub.timestamp]
        # A sub-agent starts from its parent's context: it shares more than the system prompt.
        assert max(_common(sub.hash_ids, p.hash_ids) for p in parents) > prompt_blocks
    # Multi-turn: a later turn of a main agent extends an earlier one's full blocks.
    main = [r for r in reqs if r.session == reqs[0].session and r.agent is None]
    assert len(main) >= 2 and _common(main[0].hash_ids, main[1].hash_ids) >= prompt_blocks


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"sessions": 0}, "sessions"), ({"turns": (3, 1)}, "turns"),
    ({"subagent_prob": 1.5}, "subagent_prob"), ({"think_ms": -1.0}, "think_ms"),
    ({"turn_tokens": (0, 5)}, "turn_tokens"),
])
def test_bad_config(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


def test_progress_bar_draws_only_when_enabled() -> None:
    import io

    from kvtier.progress import Progress

    out = io.StringIO()
    with Progress(10, "replay", stream=out, enabled=True) as bar:
        for _ in range(10):
            bar.update()
    text = out.getvalue()
    assert "replay [" in text and "100.0%" in text and text.endswith("\n")
    quiet = io.StringIO()  # not a terminal: nothing drawn by default
    with Progress(10, "replay", stream=quiet) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""
