"""Mooncake-format request traces: one JSON object per line, plain or gzip, streamed.

Each row has ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id
per 512-token block, prefix-chained: equal ids mean equal prefixes), optionally ``session``
and ``agent``. See ``docs/replay.md``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvtier.errors import ConfigError

__all__ = ["BLOCK_TOKENS", "Request", "iter_trace", "trace_size"]

BLOCK_TOKENS = 512


@dataclass(slots=True)
class Request:
    """One trace row: a prompt of ``input_length`` tokens in blocks ``hash_ids``."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str | None = None
    agent: str | None = None

    def to_json(self) -> dict[str, object]:
        """The row as the trace format writes it."""
        row: dict[str, object] = {"timestamp": self.timestamp, "input_length": self.input_length,
                                  "output_length": self.output_length, "hash_ids": self.hash_ids}
        if self.session is not None:
            row["session"] = self.session
            row["agent"] = self.agent
        return row


def _parse(line: bytes, lineno: int, path: str) -> Request:
    try:
        row = json.loads(line)
        hash_ids = row["hash_ids"]
        if not isinstance(hash_ids, list):
            raise TypeError("hash_ids is not a list")
        session = row.get("session")
        agent = row.get("agent")
        return Request(
            timestamp=float(row.get("timestamp", 0)),
            input_length=int(row.get("input_length") or len(hash_ids) * BLOCK_TOKENS),
            output_length=int(row.get("output_length") or 0),
            hash_ids=hash_ids,
            session=None if session is None else str(session),
            agent=None if agent is None else str(agent),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"trace: {path}:{lineno}: not a Mooncake trace row ({exc})") from exc


def trace_size(path: str | os.PathLike[str]) -> int:
    """Bytes on disk (compressed size for ``.gz``): the unit of :func:`iter_trace` progress."""
    return Path(path).stat().st_size


def iter_trace(path: str | os.PathLike[str], *, limit: int | None = None,
               on_progress: Callable[[int], None] | None = None) -> Iterator[Request]:
    """Stream the rows of a trace file (``.gz`` is decompressed on the fly).

    Parameters
    ----------
    path
        Trace file.
    limit
        Stop after this many requests.
    on_progress
        Called now and then with the bytes of the file consumed so far.

    Raises
    ------
    ConfigError
        If the file is missing or a row is malformed (naming the line).
    """
    name = os.fspath(path)
    try:
        raw: IO[bytes] = open(name, "rb")  # noqa: SIM115 - closed in the finally below
    except OSError as exc:
        raise ConfigError(f"trace: cannot open {name!r}: {exc.strerror}") from exc
    try:
        magic = raw.read(2)
        raw.seek(0)
        stream: IO[bytes] = (gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b"  # type: ignore[assignment]
                             else raw)
        count = 0
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                break
            yield _parse(line, lineno, name)
            count += 1
            if on_progress is not None and count % 64 == 0:
                on_progress(raw.tell())
        if on_progress is not None:
            on_progress(raw.tell())
    finally:
        raw.close()
