"""The timed load model of the dry replay (``kvtier replay --dry --load inflight``).

Each node serves the requests routed to it one at a time, in arrival order (the trace's
``timestamp``), so a node busy with earlier requests delays later ones. A request's service
time comes from a :class:`CostModel`: a fixed step, prefill of the tokens its prefix hit did
not cover, decode of its output tokens. A router sees, at the request's arrival time, how many
requests each node has in flight (queued or running), not how many it was given since the
start.

Modelled time to first token: queue wait + step + prefill of the uncached tokens + fetch of
the prefix blocks read from other nodes. The fetch does not occupy the node's compute (a
connector loads while the engine runs other requests' steps); the step, prefill and decode do.

Cache state is updated when a request arrives, not when its prefill ends: a block computed by
a request is visible to the very next one even if the first is still queued. This keeps every
simulation in the one pass over the trace; it flatters caches a little at high load.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.replay.trace import BLOCK_TOKENS

__all__ = ["CPU_ENGINE", "GPU_ENGINE", "CostModel", "NodeClock", "percentile"]


@dataclass(frozen=True)
class CostModel:
    """Seconds a request costs the node that serves it.

    Parameters
    ----------
    prefill_s_per_token
        Prefill time per prompt token not covered by the prefix hit.
    decode_s_per_token
        Node time per output token (decode of a batched engine: one step serves many
        sequences, so this is the step time over the batch, not the per-token latency).
    step_s
        Fixed cost of every request (scheduling, the first forward step even on a full hit).
    fetch_s_per_block
        Time to read one prefix block from another node (counted in TTFT only).
    """

    prefill_s_per_token: float
    decode_s_per_token: float
    step_s: float
    fetch_s_per_block: float

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "step_s",
                     "fetch_s_per_block"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}: expected a number >= 0, got {value!r}")

    def prefill_s(self, input_tokens: int, hit_tokens: int) -> float:
        """Step plus prefill of the tokens the hit did not cover."""
        return self.step_s + self.prefill_s_per_token * max(0, input_tokens - hit_tokens)

    def describe(self) -> dict[str, float]:
        """The parameters, for result rows."""
        return {"prefill_s_per_token": self.prefill_s_per_token,
                "decode_s_per_token": self.decode_s_per_token, "step_s": self.step_s,
                "fetch_s_per_block": self.fetch_s_per_block}


# A GPU-class engine, Llama-3.1-8B in bf16 on one H100 (docs/replay.md, "Timed replay"):
# prefill 10,000 tokens/s (the low end of the 10-20k tokens/s of docs/performance.md,
# "Fetch vs recompute"); decode 1/5,367 s per output token (TensorRT-LLM's published H100
# table: LLaMA 7B, FP8, batch 64, 128 in / 2,048 out, 5,367 output tokens/s); the step is the
# measured full-hit TTFT of bench_engine (docs/performance.md: local p50 0.026 s); a fetch
# moves 512 tokens x 128 KiB of KV over a 100 Gbit/s link (5.37 ms).
GPU_ENGINE = CostModel(prefill_s_per_token=1e-4, decode_s_per_token=1 / 5367, step_s=0.026,
                       fetch_s_per_block=BLOCK_TOKENS * (128 << 10) * 8 / 100e9)
# bench_engine's CPU engine as measured (docs/performance.md, 2,048-token prompt): a cold
# prefill 0.720 s, a full hit 0.026 s, so (0.720 - 0.026) / 2,047 s per uncached token. It
# has no decode figure; the GPU one is kept.
CPU_ENGINE = CostModel(prefill_s_per_token=(0.720 - 0.026) / 2047,
                       decode_s_per_token=1 / 5367, step_s=0.026,
                       fetch_s_per_block=GPU_ENGINE.fetch_s_per_block)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    # ceil(q * n), with a tolerance so that 0.9 * 10 is rank 9, not 10
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[min(len(ordered), rank) - 1]


class NodeClock:
    """Per-node FIFO queues on the trace's clock.

    Parameters
    ----------
    nodes
        Serving nodes.
    cost
        The :class:`CostModel` of every node.
    """

    def __init__(self, nodes: int, cost: CostModel) -> None:
        if type(nodes) is not int or nodes < 1:
            raise ValueError(f"nodes: expected an int >= 1, got {nodes!r}")
        self.nodes = nodes
        self.cost = cost
        self.now = 0.0
        self.free_at = [0.0] * nodes  # when each node finishes what it was given
        self._finishing: list[deque[float]] = [deque() for _ in range(nodes)]
        self.inflight = [0] * nodes  # requests queued or running at ``now``
        self.busy_s = [0.0] * nodes  # total service time given to each node
        self.ttft_s: list[float] = []
        self.wait_s: list[float] = []
        self.max_inflight = 0

    def advance(self, t: float) -> None:
        """Move the clock to ``t`` (never backwards): requests finished by then leave."""
        if t > self.now:
            self.now = t
        now = self.now
        for node, queue in enumerate(self._finishing):
            while queue and queue[0] <= now:
                queue.popleft()
            self.inflight[node] = len(queue)

    def remaining_s(self, node: int) -> float:
        """Seconds of work ``node`` has left at ``now``."""
        return max(0.0, self.free_at[node] - self.now)

    def serve(self, node: int, input_tokens: int, output_tokens: int, hit_tokens: int,
              remote_blocks: int) -> float:
        """Queue one request arriving at ``now`` on ``node``; returns its modelled TTFT."""
        cost = self.cost
        prefill = cost.prefill_s(input_tokens, hit_tokens)
        service = prefill + cost.decode_s_per_token * output_tokens
        start = max(self.now, self.free_at[node])
        wait = start - self.now
        finish = start + service
        self.free_at[node] = finish
        self._finishing[node].append(finish)
        self.inflight[node] += 1
        self.max_inflight = max(self.max_inflight, self.inflight[node])
        self.busy_s[node] += service
        ttft = wait + prefill + cost.fetch_s_per_block * remote_blocks
        self.ttft_s.append(ttft)
        self.wait_s.append(wait)
        return ttft

    def metrics(self) -> dict[str, Any]:
        """Result-row fields: TTFT p50/p90, queue wait, busy time per node and its balance.

        ``load_imbalance`` is the busiest node's busy time (the sum of its requests' service
        times) over the mean busy time; 1.0 is perfect.
        """
        busy = self.busy_s
        mean = sum(busy) / len(busy)
        return {"load_model": "inflight", "cost_model": self.cost.describe(),
                "ttft_p50_s": percentile(self.ttft_s, 0.5),
                "ttft_p90_s": percentile(self.ttft_s, 0.9),
                "wait_p50_s": percentile(self.wait_s, 0.5),
                "wait_p90_s": percentile(self.wait_s, 0.9),
                "busy_s": busy, "max_inflight": self.max_inflight,
                "load_imbalance": max(busy) / mean if mean else 0.0}
