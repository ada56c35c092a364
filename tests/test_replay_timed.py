"""The timed load model of the dry replay: FIFO queues per node on the trace's clock,
routers that see in-flight work, and the TTFT it models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay.dry import run_dry
from kvtier.replay.routing import LocateSimulation, live_pick, routing_metrics
from kvtier.replay.sim import Simulation
from kvtier.replay.timed import GPU_ENGINE, CostModel, NodeClock, percentile
from kvtier.replay.trace import Request

# One second per 1,000 uncached tokens, nothing else: service times are easy to add up.
SIMPLE = CostModel(prefill_s_per_token=1e-3, decode_s_per_token=0.0, step_s=0.0,
                   fetch_s_per_block=0.0)


def _req(t_s: float, ids: list[int], output: int = 0) -> Request:
    return Request(t_s * 1000, len(ids) * 512, output, ids)


def test_a_node_serves_in_arrival_order_and_later_requests_wait() -> None:
    clock = NodeClock(2, SIMPLE)
    ttfts, depth = [], []
    for t in (0.0, 0.1, 0.2):
        clock.advance(t)
        depth.append(clock.inflight[0])
        ttfts.append(clock.serve(0, 1000, 0, 0, 0))  # 1 s each
    assert depth == [0, 1, 2]  # the router saw the queue grow
    assert ttfts == pytest.approx([1.0, 1.9, 2.8])  # wait + own prefill, in order
    assert clock.wait_s == pytest.approx([0.0, 0.9, 1.8])
    clock.advance(2.5)
    assert clock.inflight == [1, 0]  # two have finished by 2.5 s, the third at 3.0 s
    clock.advance(3.0)
    assert clock.inflight == [0, 0]
    # The other node was idle all along: the busiest/mean of busy time is 2 (3 s vs 0 s).
    assert clock.metrics()["load_imbalance"] == pytest.approx(2.0)


def test_the_clock_never_runs_backwards_and_hits_shorten_prefill() -> None:
    clock = NodeClock(1, SIMPLE)
    clock.advance(5.0)
    clock.advance(1.0)
    assert clock.now == 5.0
    assert clock.serve(0, 2048, 0, 1536, 0) == pytest.approx(0.512)
    cost = CostModel(prefill_s_per_token=0.0, decode_s_per_token=0.01, step_s=0.5,
                     fetch_s_per_block=0.1)
    other = NodeClock(1, cost)
    assert other.serve(0, 512, 100, 512, 3) == pytest.approx(0.5 + 0.3)  # decode is not TTFT
    assert other.busy_s == pytest.approx([0.5 + 1.0])  # ...but occupies the node
    with pytest.raises(ValueError, match="step_s"):
        CostModel(prefill_s_per_token=0.0, decode_s_per_token=0.0, step_s=-1.0,
                  fetch_s_per_block=0.0)


def test_a_saturated_node_makes_ttft_grow_and_a_light_one_does_not() -> None:
    # 1,024-token prompts, nothing shared: 1.024 s of prefill each on one node.
    def ttfts(gap_s: float) -> list[float]:
        sim = Simulation("per-node", "rr", "lru", 1, [10_000], clock=NodeClock(1, SIMPLE))
        run_dry([_req(i * gap_s, [2 * i, 2 * i + 1]) for i in range(20)], [sim],
                block_bytes=1)
        assert sim.clock is not None
        return sim.clock.ttft_s

    saturated, light = ttfts(0.5), ttfts(2.0)
    assert saturated == sorted(saturated) and saturated[-1] > 10 * saturated[0]
    assert light == pytest.approx([1.024] * 20)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.9) == 0.0
    values = [float(i) for i in range(1, 11)]
    assert (percentile(values, 0.5), percentile(values, 0.9)) == (5.0, 9.0)
    assert percentile([3.0], 0.9) == 3.0


def test_live_pick_trades_prefix_for_queue_depth() -> None:
    # Node 0 holds the whole prompt; node 1 nothing.
    assert live_pick([10, 0], [0, 0], 10) == 0
    assert live_pick([10, 0], [3, 0], 10, weight=0.5) == 0  # 1 - 0.5 > 0
    assert live_pick([10, 0], [3, 0], 10, weight=1.5) == 1  # 1 - 1.5 < 0
    assert live_pick([4, 4], [2, 1], 10) == 1  # equal prefix: the shorter queue
    assert live_pick([0, 0, 0], [1, 1, 1], 0) == 0


def test_locate_live_sends_work_away_from_a_saturated_holder() -> None:
    # A 16-block shared prefix, then a burst of 40 prompts behind it arriving together:
    # unbounded locate queues every one on the prefix's holder; locate-live moves work to
    # the idle node once the holder's queue is deep enough to outweigh its prefix.
    prefix = list(range(16))
    warm = [_req(0.0, prefix)]
    burst = [_req(100.0 + 0.01 * i, [*prefix, 1000 + 4 * i, 1001 + 4 * i, 1002 + 4 * i])
             for i in range(40)]
    sims = {routing: LocateSimulation("per-node", routing, "lru", 2, [10_000],
                                      clock=NodeClock(2, GPU_ENGINE), live_weight=1.0)
            for routing in ("locate", "locate-live")}
    run_dry(warm + burst, list(sims.values()), block_bytes=1)
    locate, live = sims["locate"], sims["locate-live"]
    holder = locate.node_requests.index(max(locate.node_requests))
    assert locate.node_requests[holder] == 41  # everything on the holder
    assert live.node_requests[1 - holder] >= 10  # the idle node took a share
    assert live.hit_blocks < locate.hit_blocks  # ...recomputing the prefix there
    assert live.clock is not None and locate.clock is not None
    assert live.clock.metrics()["ttft_p90_s"] < locate.clock.metrics()["ttft_p90_s"]
    assert routing_metrics(live, 1)["load_imbalance"] < routing_metrics(locate, 1)[
        "load_imbalance"]


def test_locate_bounded_uses_in_flight_load_not_counts() -> None:
    # Requests far apart in time: nothing is ever in flight when the next arrives, so the
    # bounded router always picks the prefix holder; by counts it would spread them.
    reqs = [_req(10.0 * i, [1, 2, 3, 100 + i]) for i in range(12)]
    timed = LocateSimulation("per-node", "locate-bounded", "lru", 3, [100],
                             clock=NodeClock(3, SIMPLE))
    counted = LocateSimulation("per-node", "locate-bounded", "lru", 3, [100])
    run_dry(reqs, [timed, counted], block_bytes=1)
    assert sorted(timed.node_requests) == [0, 0, 12]
    assert max(counted.node_requests) < 12


def test_cli_inflight_prints_ttft_and_refuses_real(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["replay", "builtin:agentic", "--dry", "--load", "inflight", "--limit", "80",
               "--mode", "per-node,local,ideal", "--routing", "session,locate-live",
               "--step-s", "0.5", "--no-progress", "--json", str(out)])
    assert rc == 0
    assert "TTFT p50 s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["load"] == "inflight" and report["cost_model"]["step_s"] == 0.5
    for row in report["results"]:
        assert row["ttft_p50_s"] >= 0.5 and row["load_model"] == "inflight"
    assert main(["replay", "builtin:agentic", "--real", "--load", "inflight"]) == 2
    assert main(["replay", "builtin:agentic", "--mode", "local", "--policy", "arc"]) == 2
    assert "--mode local" in capsys.readouterr().err
