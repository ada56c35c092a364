"""A vLLM worker pinned to its compute cores runs the connector's threads on the engine's
other CPUs (``thread_cpus="spare"``); an unpinned worker's threads stay where they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier import ConfigError
from kvtier.integrations.cpu_affinity import spare_cpus
from kvtier.integrations.vllm_plan import ConnectorSettings

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_spare_cpus_are_the_parents_that_no_pinned_worker_uses() -> None:
    assert spare_cpus({0}, {0, 1}) == {1}
    # Another pinned worker's cores are not spare; an unpinned sibling takes none.
    assert spare_cpus({0, 1}, set(range(6)), [{2, 3}, set(range(6))]) == {4, 5}
    # Not pinned (GPU workers), or nothing left over: the threads stay where they are.
    assert spare_cpus({0, 1}, {0, 1}) == set()
    assert spare_cpus({0}, {0, 1}, [{1}]) == set()
    assert spare_cpus({0, 5}, {0, 1}) == set()  # not a subset: someone else's decision


def test_thread_cpus_setting_is_validated() -> None:
    assert ConnectorSettings.from_extra_config({"tiers": ["dram://"]}).thread_cpus == "spare"
    with pytest.raises(ConfigError, match="thread_cpus"):
        ConnectorSettings.from_extra_config({"tiers": ["dram://"], "thread_cpus": "all"})


CHILD = textwrap.dedent("""
    import json, os, sys, threading
    os.sched_setaffinity(0, {0})  # as vLLM's CPU backend pins a worker's compute thread
    from tests.helpers.vllm_fakes import FakeEngine, Request
    engine = FakeEngine({"tiers": ["dram://?capacity=4MiB"], "model": "tiny-test",
                         "thread_cpus": sys.argv[1]})
    engine.prefill(Request("r-1", list(range(1, 23))), [0, 1, 2, 3, 4, 5])  # saves 5 blocks
    worker = engine.worker._worker_side()
    store_thread = worker.store._thread.native_id
    gather_thread = next(iter(worker._gatherer._threads)).native_id
    print(json.dumps({"main": sorted(os.sched_getaffinity(0)),
                      "store": sorted(os.sched_getaffinity(store_thread)),
                      "gather": sorted(os.sched_getaffinity(gather_thread))}))
    engine.close()
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or 0 not in os.sched_getaffinity(0), reason="needs Linux and CPUs 0 and 1+")
@pytest.mark.parametrize("setting", ["spare", "inherit"])
def test_a_pinned_worker_moves_the_connectors_threads_to_spare_cpus(setting: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, setting], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    assert where["main"] == [0]  # the compute thread stays where vLLM put it
    spare = sorted(os.sched_getaffinity(0) - {0})
    if setting == "spare":
        assert where["gather"] == spare
        assert where["store"] == [0, *spare]  # also the compute CPU, idle in a sync load
    else:
        assert where["store"] == where["gather"] == [0]
