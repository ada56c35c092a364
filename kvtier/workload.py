"""A synthetic agentic workload: multi-turn sessions sharing system prompts, with sub-agents
branching off their parent's context.

Requests come out in the shape of trace rows (:class:`kvtier.replay.trace.Request`): block
ids per 512-token block, prefix-chained (equal ids mean equal prefixes), with ``session``
and ``agent``, in timestamp order, so everything that replays a trace replays this too.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.replay.trace import BLOCK_TOKENS, Request

__all__ = ["WorkloadConfig", "generate"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the generated workload (every size is in tokens unless it says blocks).

    Parameters
    ----------
    sessions
        Sessions (conversations), each a main agent plus its sub-agents.
    concurrency
        Sessions active at once (a new one starts when one ends).
    system_prompts
        Distinct system prompts; every session starts with one of them.
    system_prompt_tokens
        Length of each system prompt.
    turns
        Inclusive range of main-agent turns per session.
    turn_tokens
        Inclusive range of tokens each turn adds (user message, tool output, reply).
    subagent_prob
        Chance that a main-agent turn spawns a sub-agent from the current context.
    subagent_turns
        Inclusive range of turns of a sub-agent.
    think_ms
        Mean gap between an agent's consecutive requests.
    seed
        Random seed: the same config always yields the same requests.
    """

    sessions: int = 64
    concurrency: int = 16
    system_prompts: int = 3
    system_prompt_tokens: int = 3000
    turns: tuple[int, int] = (3, 12)
    turn_tokens: tuple[int, int] = (200, 2000)
    subagent_prob: float = 0.25
    subagent_turns: tuple[int, int] = (1, 4)
    think_ms: float = 2000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "concurrency", "system_prompts", "system_prompt_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        for name in ("turns", "turn_tokens", "subagent_turns"):
            lo, hi = getattr(self, name)
            if not (type(lo) is int and type(hi) is int and 1 <= lo <= hi):
                raise ValueError(f"{name}: expected (lo, hi) ints with 1 <= lo <= hi, "
                                 f"got {getattr(self, name)!r}")
        if not 0.0 <= self.subagent_prob <= 1.0:
            raise ValueError(f"subagent_prob: expected 0..1, got {self.subagent_prob!r}")
        if self.think_ms < 0:
            raise ValueError(f"think_ms: expected >= 0, got {self.think_ms!r}")


@dataclass
class _Context:
    """A token sequence as full-block ids plus the tokens of a trailing partial block."""

    blocks: list[int]
    partial: int = 0

    def copy(self) -> _Context:
        return _Context(list(self.blocks), self.partial)


@dataclass(order=True)
class _Agent:
    next_ms: float
    seq: int
    session: str = field(compare=False)
    agent: str | None = field(compare=False)
    context: _Context = field(compare=False)
    turns_left: int = field(compare=False)
    subagents: int = field(compare=False, default=0)


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def _grow(ctx: _Context, tokens: int, ids: _Ids) -> None:
    # The old partial block's content changes, so every block it becomes part of is new.
    total = ctx.partial + tokens
    ctx.blocks.extend(ids.take() for _ in range(total // BLOCK_TOKENS))
    ctx.partial = total % BLOCK_TOKENS


def _request(agent: _Agent, ids: _Ids, rng: random.Random) -> Request:
    ctx = agent.context
    hash_ids = list(ctx.blocks)
    if ctx.partial:
        hash_ids.append(ids.take())  # a partial block is unique to this prompt
    return Request(timestamp=round(agent.next_ms), input_length=len(ctx.blocks) * BLOCK_TOKENS
                   + ctx.partial, output_length=rng.randint(50, 800), hash_ids=hash_ids,
                   session=agent.session, agent=agent.agent)


def generate(config: WorkloadConfig | None = None) -> Iterator[Request]:
    """Yield the workload's requests in timestamp order."""
    cfg = config or WorkloadConfig()
    rng = random.Random(cfg.seed)
    ids = _Ids()
    prompts = []
    for _ in range(cfg.system_prompts):
        ctx = _Context([])
        _grow(ctx, cfg.system_prompt_tokens, ids)
        prompts.append(ctx)
    heap: list[_Agent] = []
    seq = 0
    started = 0

    def start_session(at_ms: float) -> None:
        nonlocal seq, started
        ctx = rng.choice(prompts).copy()
        _grow(ctx, rng.randint(*cfg.turn_tokens), ids)
        heapq.heappush(heap, _Agent(at_ms, seq, f"s{started:04d}", None, ctx,
                                    rng.randint(*cfg.turns)))
        seq += 1
        started += 1

    for _ in range(min(cfg.concurrency, cfg.sessions)):
        start_session(rng.uniform(0, cfg.think_ms))
    while heap:
        agent = heapq.heappop(heap)
        yield _request(agent, ids, rng)
        agent.turns_left -= 1
        if agent.agent is None and agent.turns_left > 0 and rng.random() < cfg.subagent_prob:
            agent.subagents += 1
            child = agent.context.copy()
            _grow(child, rng.randint(*cfg.turn_tokens), ids)  # the sub-agent's task
            heapq.heappush(heap, _Agent(agent.next_ms + rng.expovariate(1 / (cfg.think_ms or 1)),
                                        seq, agent.session, f"sub{agent.subagents}", child,
                                        rng.randint(*cfg.subagent_turns)))
            seq += 1
        if agent.turns_left > 0:
            _grow(agent.context, rng.randint(*cfg.turn_tokens), ids)
            agent.next_ms += rng.expovariate(1 / cfg.think_ms) if cfg.think_ms else 0.0
            agent.seq = seq
            seq += 1
            heapq.heappush(heap, agent)
        elif agent.agent is None and started < cfg.sessions:
            start_session(agent.next_ms + rng.expovariate(1 / (cfg.think_ms or 1)))
