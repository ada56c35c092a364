"""The README's quickstart runs as written (with its LMDB path moved into a temp dir)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quickstart_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README quickstart has no python block"
    source = code.group(1)
    assert "/tmp/kvtier-nvme" in source
    script = tmp_path / "quickstart.py"
    script.write_text(source.replace("/tmp/kvtier-nvme", str(tmp_path / "nvme")), "utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["(0, 16)", "(16, 24)", "16"]
    # aclose() copied DRAM into LMDB: the second run is warm (issue 9, bug 14).
    again = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[:2] == ["(16, 16)", "(24, 24)"]
