"""``kvtier bench``: run the project's benchmarks and print one summary table.

Benchmarks are the modules ``benchmarks/bench_<name>.py`` of a kvtier checkout, each with
``run(quick: bool) -> list[Result]`` (see ``benchmarks/common.py``). Every result carries
its ratio against a baseline measured in the same run (numpy copy, raw socket, ...).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from kvtier.commands import check_output_file
from kvtier.errors import ConfigError

NAME = "bench"
HELP = "run kvtier's benchmarks (quick by default) and print one summary table with ratios"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench``."""
    parser.add_argument("--full", action="store_true", help="the long run (default: quick)")
    parser.add_argument("--only", metavar="NAMES",
                        help="comma-separated benchmarks to run, e.g. core,persist,peer")
    parser.add_argument("--dir", metavar="DIR",
                        help="benchmarks folder (default: next to the kvtier package, in a "
                             "source checkout, or ./benchmarks)")
    parser.add_argument("--json", metavar="FILE", help="write every result row as JSON")
    parser.add_argument("--list", action="store_true", help="list benchmarks and exit")


def find_dir(explicit: str | None) -> Path | None:
    """The benchmarks folder: ``explicit``, else the checkout's, else ``./benchmarks``."""
    if explicit:
        path = Path(explicit)
        return path if path.is_dir() else None
    import kvtier

    for candidate in (Path(kvtier.__file__).resolve().parent.parent / "benchmarks",
                      Path.cwd() / "benchmarks"):
        if candidate.is_dir():
            return candidate
    return None


def discover(directory: Path) -> dict[str, Path]:
    """``{name: path}`` of every ``bench_<name>.py`` in ``directory``, sorted by name."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(directory.glob("bench_*.py"))}


def load(name: str, path: Path) -> ModuleType:
    """Import a benchmark module from its file (its folder's parent goes on ``sys.path`` so
    ``from benchmarks.common import ...`` resolves to the same checkout)."""
    root = str(path.parent.parent)
    if root not in sys.path:
        sys.path.append(root)
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}.bench_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise ImportError(f"{path} defines no run(quick) function")
    return module


def summary_lines(results: list[Any]) -> list[str]:
    """The summary table: one line per result, with its in-run baseline ratio."""
    header = (f"{'bench':<10} {'case':<36} {'size':>6} {'conc':>4} {'ops/s':>10} {'GB/s':>8} "
              f"{'p50 us':>9} "
              f"{'p99 us':>9} {'ratio':>7}  baseline")
    lines = [header, "-" * len(header)]
    for r in results:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        lines.append(f"{r.bench:<10} {r.case[:36]:<36} {r.size:>6} {r.concurrency:>4} "
                     f"{r.ops_per_s:>10.0f} "
                     f"{r.gbps:>8.2f} {r.pct(0.5) * 1e6:>9.1f} {r.pct(0.99) * 1e6:>9.1f} "
                     f"{ratio:>7}  {r.baseline or ''}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; exit status 1 if any failed, 2 on bad arguments."""
    directory = find_dir(args.dir)
    if directory is None:
        where = f"--dir {args.dir!r} is not a folder" if args.dir else (
            "no benchmarks/ folder next to the kvtier package or in the current directory")
        print(f"kvtier bench: {where}. The benchmarks ship with the source checkout: run from "
              "a clone of kvtier or pass --dir PATH/benchmarks.", file=sys.stderr)
        return 2
    try:
        check_output_file(args.json, "--json")
    except ConfigError as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    found = discover(directory)
    if args.list:
        print("\n".join(found) or "(none)")
        return 0
    names = list(found)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in found]
        if unknown or not names:
            print(f"kvtier bench: --only: unknown {', '.join(unknown) or '(empty)'}; "
                  f"available in {directory}: {', '.join(found) or 'none'}", file=sys.stderr)
            return 2
    if not names:
        print(f"kvtier bench: no bench_*.py modules in {directory}", file=sys.stderr)
        return 2
    quick = not args.full
    results: list[Any] = []
    report: dict[str, Any] = {"quick": quick, "directory": str(directory), "benchmarks": {}}
    failed = []
    for name in names:
        print(f"[bench] {name} ({'quick' if quick else 'full'}) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            rows = list(load(name, found[name]).run(quick=quick))
        except Exception as exc:  # one broken benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
            report["benchmarks"][name] = {"status": "failed", "error": repr(exc),
                                          "seconds": time.perf_counter() - t0}
            continue
        seconds = time.perf_counter() - t0
        results += rows
        report["benchmarks"][name] = {"status": "ok", "seconds": round(seconds, 2),
                                      "results": [r.row() for r in rows]}
        print(f"[bench] {name}: {len(rows)} results in {seconds:.1f} s", file=sys.stderr)
    print(f"\n## kvtier bench ({'quick' if quick else 'full'}): {', '.join(names)}")
    print("\n".join(summary_lines(results)))
    if failed:
        print(f"\nFAILED: {', '.join(failed)} (tracebacks above)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.json}")
    return 1 if failed else 0
