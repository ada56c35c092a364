"""``kvtier replay --dry --load count`` reproduces the counting replay's numbers exactly.

The figures below were produced by the replay before the timed model existed (main at
6bb312c, ``kvtier replay builtin:agentic --limit 400 --nodes 4 --capacity-blocks 40,120
--mode per-node,pooled,ideal --routing rr,session,locate-bounded,owner --policy lru,arc``):
hit blocks, remote bytes read, remote bytes written and the busiest node's requests over
the mean, per configuration. A change to the counting path that moves any of them fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.cli import main

# (mode, routing, policy, C): (hit blocks, remote read bytes, remote written bytes, load)
PINNED = {
    ("per-node", "rr", "lru", 40): (1973, 0, 0, 1.0),
    ("per-node", "session", "lru", 40): (3513, 0, 0, 1.14),
    ("per-node", "locate-bounded", "lru", 40): (4042, 0, 0, 1.06),
    ("per-node", "owner", "lru", 40): (3484, 0, 0, 1.22),
    ("per-node", "rr", "arc", 40): (2224, 0, 0, 1.0),
    ("per-node", "session", "arc", 40): (3540, 0, 0, 1.14),
    ("per-node", "locate-bounded", "arc", 40): (3754, 0, 0, 1.08),
    ("per-node", "owner", "arc", 40): (3469, 0, 0, 1.22),
    ("pooled", "rr", "lru", 40): (3975, 194576384, 131399680, 1.0),
    ("pooled", "session", "lru", 40): (3975, 189857792, 124649472, 1.14),
    ("pooled", "locate-bounded", "lru", 40): (3975, 185729024, 130744320, 1.22),
    ("pooled", "owner", "lru", 40): (3975, 185597952, 130678784, 1.22),
    ("pooled", "rr", "arc", 40): (3966, 194379776, 122028032, 1.0),
    ("pooled", "session", "arc", 40): (3966, 189726720, 116129792, 1.14),
    ("pooled", "locate-bounded", "arc", 40): (3966, 185401344, 122421248, 1.22),
    ("pooled", "owner", "arc", 40): (3966, 185270272, 122355712, 1.22),
    ("ideal", "none", "lru", 40): (4160, 0, 0, 0),
    ("ideal", "none", "arc", 40): (4250, 0, 0, 0),
    ("per-node", "rr", "lru", 120): (3423, 0, 0, 1.0),
    ("per-node", "session", "lru", 120): (5171, 0, 0, 1.14),
    ("per-node", "locate-bounded", "lru", 120): (5138, 0, 0, 1.18),
    ("per-node", "owner", "lru", 120): (4708, 0, 0, 1.22),
    ("per-node", "rr", "arc", 120): (3382, 0, 0, 1.0),
    ("per-node", "session", "arc", 120): (5182, 0, 0, 1.14),
    ("per-node", "locate-bounded", "arc", 120): (5098, 0, 0, 1.13),
    ("per-node", "owner", "arc", 120): (4668, 0, 0, 1.22),
    ("pooled", "rr", "lru", 120): (5285, 259325952, 67174400, 1.0),
    ("pooled", "session", "lru", 120): (5285, 252313600, 63832064, 1.14),
    ("pooled", "locate-bounded", "lru", 120): (5285, 250019840, 65994752, 1.22),
    ("pooled", "owner", "lru", 120): (5285, 249888768, 66125824, 1.22),
    ("pooled", "rr", "arc", 120): (5254, 257818624, 68681728, 1.0),
    ("pooled", "session", "arc", 120): (5254, 250347520, 65339392, 1.14),
    ("pooled", "locate-bounded", "arc", 120): (5254, 247922688, 68222976, 1.22),
    ("pooled", "owner", "arc", 120): (5254, 247791616, 68354048, 1.22),
    ("ideal", "none", "lru", 120): (5321, 0, 0, 0),
    ("ideal", "none", "arc", 120): (5285, 0, 0, 0),
}


def test_count_load_reproduces_the_counting_replay(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(["replay", "builtin:agentic", "--dry", "--load", "count", "--limit", "400",
               "--nodes", "4", "--capacity-blocks", "40,120", "--mode", "per-node,pooled,ideal",
               "--routing", "rr,session,locate-bounded,owner", "--policy", "lru,arc",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["requests"], report["block_refs"]) == (400, 6639)
    got = {(r["mode"], r["routing"], r["policy"], r["capacity_blocks"]):
           (r["hit_blocks"], r["bytes_remote_read"], r["bytes_remote_written"],
            r.get("load_imbalance", 0)) for r in report["results"]}
    assert got == PINNED
