"""Every examples/*.py runs as a user would run it (``python examples/x.py``) and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# Output an example must print (regexes), beyond exiting 0; examples not listed only need to
# exit 0 and print something.
EXPECTED: dict[str, list[str]] = {
    "embed_in_server.py": [
        r"prefix hit rate: (\d+\.\d)%",
        r"block get hit rate: 100\.0%",
        r"all cached blocks verified",
        r"tier hot .*promotions=[1-9]",
        r"tier warm .*demotions=[1-9]",
    ],
    "scheduler_threads.py": [
        r"4 threads, 480 prompt blocks, [1-9]\d* served from kvtier",
        r"closed: queued writes flushed, loop thread joined",
    ],
    "vllm_connector_walkthrough.py": [
        r"B: external hit 64 tokens, asynchronous load: False",  # nothing else runs in B
        r"bytes equal to A's blocks \[0, 1, 2, 3\]: True",
    ],
}


def test_there_are_examples() -> None:
    assert any(p.name == "embed_in_server.py" for p in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(example: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(example.relative_to(ROOT))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"{example.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{example.name} printed nothing"
    for pattern in EXPECTED.get(example.name, []):
        assert re.search(pattern, proc.stdout), f"{example.name}: no {pattern!r} in\n{proc.stdout}"
    if example.name == "embed_in_server.py":
        rate = float(re.findall(r"prefix hit rate: (\d+\.\d)%", proc.stdout)[0])
        assert 50.0 < rate < 100.0  # shared system prompts hit, fresh suffixes do not
