"""Subcommands of the ``kvtier`` CLI (see :mod:`kvtier.cli`)."""
