"""Subcommands of the ``kvtier`` CLI (see :mod:`kvtier.cli`), and the checks they share."""

from __future__ import annotations

import os

from kvtier.errors import ConfigError

__all__ = ["check_output_file"]


def check_output_file(path: str | None, option: str) -> None:
    """Refuse an output file that cannot be written before a long run starts, not after.

    Raises
    ------
    ConfigError
        Naming ``option`` and the path when its directory is missing or not writable, or
        the path is a directory.
    """
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{option}: {path!r} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise ConfigError(f"{option}: cannot write {path!r}: no directory {directory!r}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}: cannot write {path!r}: directory {directory!r} is not "
                          "writable")
