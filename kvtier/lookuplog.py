"""The lookup hash log: every ``lookup_prefix`` of a store, its keys and its result, as
rotating JSON lines, and the comparison of two instances' logs (``kvtier explain --log A
--log B``) that says which namespace fields make them hash one prompt differently.

Turn it on with the store option ``lookup_log="PATH[?max_bytes=64MiB&backups=3&instance=NAME]"``
(``open_store``, ``BlockingStore``, the vLLM connector's ``store_options``). One line per
lookup::

    {"ts": 1764650000.1, "instance": "engine-a", "hit": 3, "keys": ["9f...", ...],
     "namespace": {"model": "llama", "dtype": "bf16", "layout": "", "tp_rank": 0,
                   "tp_size": 1, "schema_version": 1, "salt": "5e1f..."},
     "block_tokens": 16, "prompt": ["a01c...", ...]}

``namespace``, ``block_tokens`` and ``prompt`` are there when the keys came from
:func:`kvtier.prefix_keys` (a :class:`~kvtier.keys.PrefixKeys`): ``prompt`` holds, per block,
a digest of the tokens up to its end that does not depend on the namespace or the block
size, so two instances' lines about one prompt can be matched although their keys differ.
The salt is logged as a digest (it separates tenants; the log does not reveal it).

Writing never blocks the event loop: :meth:`LookupLog.record` formats the line and queues
it; a :class:`logging.handlers.QueueListener` thread writes it through a
:class:`~logging.handlers.RotatingFileHandler` (``max_bytes`` per file, ``backups`` old files).
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import os
import queue
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import PrefixKeys
from kvtier.urls import parse_size

__all__ = ["LogDiff", "LookupLog", "diff_logs", "log_files", "open_lookup_log", "read_log"]

_OPTIONS = ("max_bytes", "backups", "instance")
#: Namespace fields in the order a report names them, with the block size last.
FIELDS = ("model", "dtype", "layout", "tp_rank", "tp_size", "schema_version", "salt",
          "block_tokens")


class LookupLog:
    """Writes one JSON line per lookup to ``path``, rotating at ``max_bytes``.

    Parameters
    ----------
    path
        The log file (its directory must exist).
    max_bytes
        Size at which the file is rotated (``path.1``, ... ``path.<backups>``).
    backups
        Rotated files kept.
    instance
        This instance's name in every line (default ``HOST:PID``).

    Notes
    -----
    :meth:`record` runs on the caller's thread and only queues; one background thread
    writes. :meth:`close` writes what is queued and stops the thread.
    """

    def __init__(self, path: str, *, max_bytes: int = 64 << 20, backups: int = 3,
                 instance: str | None = None) -> None:
        if max_bytes < 1 or backups < 0:
            raise ConfigError(f"lookup_log: max_bytes must be >= 1 and backups >= 0, got "
                              f"{max_bytes} and {backups}")
        try:
            handler = logging.handlers.RotatingFileHandler(
                path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"lookup_log: cannot open {path!r}: {exc}") from None
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.path = path
        self.instance = instance or f"{socket.gethostname()}:{os.getpid()}"
        self.lines = 0
        self._handler = handler
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        self._listener.start()
        self._closed = False

    def record(self, keys: Sequence[bytes], hit: int) -> None:
        """Log one lookup of ``keys`` that found ``hit`` leading keys."""
        if self._closed:
            return
        line: dict[str, Any] = {"ts": round(time.time(), 3), "instance": self.instance,
                                "hit": hit, "keys": [k.hex() for k in keys]}
        if isinstance(keys, PrefixKeys):
            ns = keys.namespace
            salt = ns.salt.encode("utf-8") if isinstance(ns.salt, str) else ns.salt
            line["namespace"] = {
                "model": ns.model, "dtype": ns.dtype, "layout": ns.layout,
                "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                "schema_version": ns.schema_version,
                "salt": hashlib.blake2b(salt, digest_size=8).hexdigest() if salt else ""}
            line["block_tokens"] = keys.block_tokens
            line["prompt"] = keys.prefix_digests()
        self._queue.put(logging.makeLogRecord({"msg": json.dumps(line, separators=(",", ":"))}))
        self.lines += 1

    def close(self) -> None:
        """Write what is queued, stop the writer thread and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._listener.stop()
        self._handler.close()

    def stats(self) -> dict[str, Any]:
        """``path`` and ``lines`` written so far."""
        return {"path": self.path, "lines": self.lines}


def open_lookup_log(spec: object, instance: str | None = None) -> LookupLog | None:
    """The log a ``lookup_log`` store option asks for (``None``: none)."""
    if spec is None or spec == "":
        return None
    if not isinstance(spec, str):
        raise ConfigError(f"lookup_log: expected a path string, got {type(spec).__name__}")
    path, _, query = spec.partition("?")
    opts: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        name, _, value = part.partition("=")
        if name not in _OPTIONS:
            raise ConfigError(f"lookup_log: unknown option {name!r} (options: "
                              f"{', '.join(_OPTIONS)})")
        opts[name] = value
    try:
        backups = int(opts.get("backups", "3"))
    except ValueError:
        raise ConfigError(f"lookup_log: backups: expected an int, got "
                          f"{opts['backups']!r}") from None
    return LookupLog(path, max_bytes=parse_size(opts.get("max_bytes", "64MiB")),
                     backups=backups, instance=opts.get("instance") or instance)


# ---------------------------------------------------------------------- reading, comparing
def log_files(path: str) -> list[str]:
    """``path`` and the files it rotated into (``path.1``, ``path.2``, ...), oldest first."""
    rotated: list[str] = []
    n = 1
    while os.path.exists(f"{path}.{n}"):
        rotated.append(f"{path}.{n}")
        n += 1
    return [*reversed(rotated), path]


def read_log(paths: Iterable[str]) -> list[dict[str, Any]]:
    """The lines of one instance's log files (rotated ones too, in any order).

    Raises
    ------
    ConfigError
        Naming the file and line that cannot be read or is not a lookup log line.
    """
    lines: list[dict[str, Any]] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                for n, text in enumerate(f, 1):
                    if not text.strip():
                        continue
                    try:
                        line = json.loads(text)
                    except ValueError as exc:
                        raise ConfigError(f"--log: {path}:{n}: not JSON: {exc}") from None
                    if not isinstance(line, dict) or not isinstance(line.get("keys"), list):
                        raise ConfigError(f"--log: {path}:{n}: not a lookup log line")
                    lines.append(line)
        except OSError as exc:
            raise ConfigError(f"--log: cannot read {path!r}: {exc}") from None
    return lines


@dataclass
class LogDiff:
    """What two instances' lookup logs say about one another.

    Attributes
    ----------
    names
        The two instances' names (from their lines).
    lookups, hits
        Per instance: lookups logged, and those that found at least one block.
    shared
        Prompt prefixes (equal tokens, equal token count) both logged.
    same
        Of ``shared``, those both hashed to the same key.
    fields
        For the prefixes hashed differently: each differing field with both values, and
        how many such prefixes it concerns.
    untraced
        Lookups without namespace (keys not made by ``prefix_keys``), per instance.
    """

    names: tuple[str, str]
    lookups: tuple[int, int]
    hits: tuple[int, int]
    shared: int = 0
    same: int = 0
    fields: dict[str, tuple[object, object, int]] = field(default_factory=dict)
    untraced: tuple[int, int] = (0, 0)

    def summary(self) -> str:
        """One instance's log in words (the first of the two)."""
        name, n, h = self.names[0], self.lookups[0], self.hits[0]
        out = [f"{name}: {n} lookups, {h} found at least one block"]
        if self.untraced[0]:
            out.append(f"{self.untraced[0]} lookups carry no namespace (keys not made by "
                       "kvtier.prefix_keys)")
        out.append("give a second instance's log (--log B) to compare their hashes")
        return "\n".join(out)

    def report(self) -> str:
        """The comparison in words."""
        a, b = self.names
        out = [f"{name}: {n} lookups, {h} found at least one block"
               for name, n, h in zip(self.names, self.lookups, self.hits, strict=True)]
        for name, n in zip(self.names, self.untraced, strict=True):
            if n:
                out.append(f"{name}: {n} lookups carry no namespace (keys not made by "
                           "kvtier.prefix_keys, e.g. key_scheme=page-sha256): not compared")
        if not self.shared:
            out.append("no prompt prefix appears in both logs: nothing to compare (the "
                       "instances saw different prompts)")
            return "\n".join(out)
        different = self.shared - self.same
        out.append(f"{self.shared} prompt prefixes appear in both logs; {self.same} hash alike")
        if not different:
            out.append(f"{b} hashes them as {a} does: the namespaces agree")
            return "\n".join(out)
        out.append(f"{b} hashes {different} of them differently from {a}:")
        for name, (va, vb, n) in self.fields.items():
            out.append(f"  {name} differs: {va!r} in {a}, {vb!r} in {b} ({n} prefixes)")
        if not self.fields:
            out.append("  no namespace field differs: the key schema or kvtier version does")
        return "\n".join(out)


def diff_logs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> LogDiff:
    """Compare two instances' logs (:func:`read_log`): match their lines' prompt prefixes
    by token digest and token count, and name the fields in which the prefixes hashed
    differently disagree."""
    seen: dict[tuple[int, str], tuple[str, dict[str, Any]]] = {}
    for line in a:
        for count, digest, key in _prefixes(line):
            seen.setdefault((count, digest), (key, line))
    shared = same = 0
    fields: dict[str, tuple[object, object, int]] = {}
    matched: set[tuple[int, str]] = set()
    for line in b:
        for count, digest, key in _prefixes(line):
            found = seen.get((count, digest))
            if found is None or (count, digest) in matched:
                continue
            matched.add((count, digest))
            shared += 1
            if found[0] == key:
                same += 1
                continue
            for name, va, vb in _differences(found[1], line):
                _, _, n = fields.get(name, (va, vb, 0))
                fields[name] = (va, vb, n + 1)
    names = (_name(a, "A"), _name(b, "B"))
    if names[0] == names[1]:
        names = (f"{names[0]} (A)", f"{names[1]} (B)")
    return LogDiff(names=names, lookups=(len(a), len(b)),
                   hits=(sum(1 for x in a if x.get("hit")), sum(1 for x in b if x.get("hit"))),
                   shared=shared, same=same, fields=fields,
                   untraced=(sum(1 for x in a if "prompt" not in x),
                             sum(1 for x in b if "prompt" not in x)))


def _prefixes(line: dict[str, Any]) -> Iterable[tuple[int, str, str]]:
    prompt, block = line.get("prompt"), line.get("block_tokens")
    if not isinstance(prompt, list) or not isinstance(block, int):
        return ()
    return ((block * (i + 1), str(d), str(k))
            for i, (d, k) in enumerate(zip(prompt, line["keys"], strict=False)))


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, object, object]]:
    na, nb = a.get("namespace") or {}, b.get("namespace") or {}
    values = [(f, na.get(f), nb.get(f)) for f in FIELDS[:-1]]
    values.append(("block_tokens", a.get("block_tokens"), b.get("block_tokens")))
    return [(f, va, vb) for f, va, vb in values if va != vb]


def _name(lines: list[dict[str, Any]], default: str) -> str:
    return str(lines[0].get("instance") or default) if lines else default
