"""The ``kvtier`` command line: one subcommand per module in :mod:`kvtier.commands`.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; heavy imports stay inside ``run`` so ``kvtier --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["COMMAND_MODULES", "build_parser", "main"]

COMMAND_MODULES = ("demo", "serve", "replay", "bench", "stats", "gc", "explain")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available subcommand."""
    from kvtier import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description=(
        "Pool the KV cache of LLM inference servers across memory tiers and machines."))
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"kvtier.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvtier.commands.{module_name}":
                raise
            continue
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script."""
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
