"""Replay results: the stable JSON document, the text table and the optional plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["format_table", "make_report", "write_json", "write_plot"]


def make_report(trace: str, requests: int, block_refs: int, nodes: int,
                capacity_blocks: Sequence[int], results: list[dict[str, Any]],
                **extra: Any) -> dict[str, Any]:
    """The JSON document (schema in ``docs/replay.md``; rates are fractions in [0, 1])."""
    return {"trace": trace, "requests": requests, "block_refs": block_refs, "nodes": nodes,
            "capacity_blocks": capacity_blocks[0], "capacities": list(capacity_blocks),
            "results": results, **extra}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_table(report: dict[str, Any]) -> str:
    """One line per result row: hit rates, tier shares, remote share, bytes moved."""
    rows = report["results"]
    header = (f"{'mode':<9} {'routing':<15} {'policy':<8} {'C/node':>7} {'hit(blk)':>9} "
              f"{'hit(tok)':>9} {'hit % by tier':<20} {'remote':>7} {'moved':>10}")
    extra_cols = any("p50_ms" in r for r in rows)
    if extra_cols:
        header += f" {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}"
    lines = [f"trace {report['trace']}: {report['requests']:,} requests, "
             f"{report['block_refs']:,} block refs, {report['nodes']} nodes", header,
             "-" * len(header)]
    for r in rows:
        shares = "/".join(f"{s * 100:.0f}" for s in r.get("tier_hit_share", []))
        line = (f"{r['mode']:<9} {r['routing']:<15} {r['policy']:<8} {r['capacity_blocks']:>7} "
                f"{_pct(r['prefix_hit_rate_blocks']):>9} {_pct(r['prefix_hit_rate_tokens']):>9} "
                f"{shares:<20} {_pct(r['remote_share']):>7} {_bytes(r.get('bytes_moved', 0)):>10}")
        if extra_cols:
            line += (f" {r.get('requests_per_s', 0):>7.1f} {r.get('p50_ms', 0):>7.2f}"
                     f" {r.get('p99_ms', 0):>7.2f}")
        lines.append(line)
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the report as JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")


def write_plot(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Plot prefix hit rate against capacity, one line per (mode, routing, policy).

    Raises
    ------
    ConfigError
        If matplotlib is not installed (``pip install kvtier[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("plot: matplotlib is not installed; pip install 'kvtier[plot]'") \
            from exc
    series: dict[str, list[tuple[int, float]]] = {}
    for r in report["results"]:
        label = r["mode"] if r["mode"] == "ideal" else f"{r['mode']} ({r['routing']})"
        label += f" {r['policy']}"
        series.setdefault(label, []).append(
            (r["capacity_blocks"], r["prefix_hit_rate_blocks"] * 100))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("capacity per node (blocks)")
    ax.set_ylabel("prefix hit rate (% of blocks)")
    ax.set_title(f"{os.path.basename(report['trace'])}, {report['nodes']} nodes")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
