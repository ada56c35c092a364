"""``kvtier explain URL... --key HEX | --prefix-of TOKENS_FILE``: where blocks are, and why not.

Opens the tiers (top first, as ``open_store`` would), probes each for the keys with its
presence check (nothing is read, no recency changes) and prints, per key, the tier that
holds it or why none does (see ``docs/troubleshooting.md``). ``--prefix-of`` hashes a
prompt's token ids into its block keys with the namespace options, as an engine connector
does; the file holds the token ids as a JSON list or separated by whitespace or commas
(``-``: standard input).

This process opens the tiers afresh: it sees what they hold and which of them fail to
answer, but not the eviction records of the process that runs the store (that process's
``store.explain`` and ``stats()["miss_reasons"]`` have them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, KVTierError
from kvtier.misses import REASON_HELP, MissReason
from kvtier.redact import mask_secrets

if TYPE_CHECKING:
    from kvtier.store import TieredStore
    from kvtier.tiers.base import Tier

__all__ = ["HELP", "NAME", "add_arguments", "read_tokens", "run"]

NAME = "explain"
HELP = "say where blocks are held and why a block misses (per tier)"

_SEPARATORS = re.compile(r"[\s,]+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier explain``."""
    parser.add_argument("urls", nargs="*", metavar="URL",
                        help="tier URLs, top first (as the store was opened)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--key", action="append", metavar="HEX",
                      help="a block key in lowercase hex (repeat for more)")
    what.add_argument("--prefix-of", metavar="TOKENS_FILE",
                      help="a prompt's token ids (JSON list, or separated by whitespace or "
                           "commas; - for stdin): explain each of its full blocks' keys")
    what.add_argument("--log", action="append", metavar="FILE",
                      help="a lookup log (store option lookup_log=; its rotated FILE.1 ... "
                           "are read too): give two, one per instance, to say why they hash "
                           "the same prompts differently; one to summarise it")
    keys = parser.add_argument_group("key namespace (with --prefix-of; as the engine set it)")
    keys.add_argument("--block-tokens", type=int, metavar="N", help="tokens per block")
    keys.add_argument("--model", help="model name of the key namespace")
    keys.add_argument("--dtype", default="", help="KV cache dtype (e.g. bfloat16)")
    keys.add_argument("--layout", default="", help="engine layout tag")
    keys.add_argument("--tp-rank", type=int, default=0, metavar="R", help="tensor-parallel rank")
    keys.add_argument("--tp-size", type=int, default=1, metavar="N", help="tensor-parallel size")
    keys.add_argument("--salt", default="", help="tenant / request salt")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="deadline for each tier's answer (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def read_tokens(path: str) -> list[int]:
    """Token ids from ``path`` (``-``: stdin): a JSON list of ints, or ints separated by
    whitespace or commas.

    Raises
    ------
    ConfigError
        If the file cannot be read or holds anything but non-negative integers.
    """
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prefix-of: cannot read {path!r}: {exc}") from None
    stripped = text.strip()
    try:
        values: Any = json.loads(stripped) if stripped.startswith("[") else \
            [int(t) for t in _SEPARATORS.split(stripped) if t]
    except ValueError as exc:
        raise ConfigError(f"--prefix-of: {path!r}: expected integer token ids: {exc}") from None
    if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"--prefix-of: {path!r}: expected a list of non-negative integer "
                          "token ids")
    if not values:
        raise ConfigError(f"--prefix-of: {path!r} holds no token ids")
    return values


async def _open(args: argparse.Namespace) -> TieredStore | int:
    """The store over the URLs, or the exit status: 2 for a URL that does not parse, 1 for
    tiers that cannot open. Nothing is written (:func:`_reader`), and closing copies
    nothing down (``close_flush=False``)."""
    from kvtier.open import open_store

    tiers: list[Tier] = []
    try:
        for url in args.urls:
            tiers.append(_reader(url))
    except (KVTierError, ValueError, TypeError) as exc:
        await _close(tiers)
        print(f"kvtier explain: {exc}")
        return 2
    try:
        for tier in tiers:  # open_store opens only the tiers it builds itself
            opener = getattr(tier, "open", None)
            if opener is not None:
                await opener()
        return await open_store(tiers, close_flush=False, timeout=args.timeout)
    except (KVTierError, OSError) as exc:
        await _close(tiers)
        print(f"kvtier explain: cannot open {mask_secrets(' '.join(args.urls))}: {exc}")
        return 1


def _reader(url: str) -> Tier:
    """The tier of ``url``, made to write nothing: ``lmdb://`` is opened read-only
    (:class:`~kvtier.tiers.lmdb_readonly.ReadOnlyLMDBTier`: no directory created, no lock
    taken, and it reads beside the process that owns the directory); a ``file://`` tier
    skips its write probe and has no fleet member (no use log, no background gc, no
    watch)."""
    from kvtier.tiers.fsspec import FsspecTier
    from kvtier.tiers.fsspec_readonly import ProbeMode
    from kvtier.tiers.lmdb_readonly import ReadOnlyLMDBTier
    from kvtier.tiers.registry import tier_from_url

    if url.split("://", 1)[0].lower() == "lmdb":
        return ReadOnlyLMDBTier.from_url(url)
    tier = tier_from_url(url)
    if isinstance(tier, FsspecTier):
        tier.probe = ProbeMode.OFF
        tier.fleet = None  # built, never started: its use log and gc write the directory
    return tier


async def _close(tiers: list[Tier]) -> None:
    for tier in tiers:
        try:
            await tier.aclose()
        except Exception as exc:  # closing what failed to open: report it, keep closing
            print(f"kvtier explain: closing {tier.name}: {exc}")


def _keys(args: argparse.Namespace) -> list[bytes]:
    from kvtier.keys import KeyNamespace, key_from_hex, prefix_keys

    if args.key:
        return [key_from_hex(text, "--key") for text in args.key]
    if args.block_tokens is None or args.block_tokens < 1:
        raise ConfigError("--block-tokens: required with --prefix-of (an int >= 1, the "
                          "engine's block size)")
    if not args.model:
        raise ConfigError("--model: required with --prefix-of (the key namespace's model)")
    tokens = read_tokens(args.prefix_of)
    try:
        namespace = KeyNamespace(model=args.model, dtype=args.dtype, layout=args.layout,
                                 tp_rank=args.tp_rank, tp_size=args.tp_size, salt=args.salt)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"key namespace: {exc}") from None
    keys = prefix_keys(tokens, args.block_tokens, namespace)
    if not keys:
        raise ConfigError(f"--prefix-of: {len(tokens)} tokens make no full block of "
                          f"{args.block_tokens}")
    return keys


def run(args: argparse.Namespace) -> int:
    """Explain the keys (or compare lookup logs); 0 when explained, 2 on bad input (a
    malformed URL, option or log), 1 when the tiers cannot open (unreachable, a wrong or
    missing token, a locked directory)."""
    if args.log:
        return _compare_logs(args)
    try:
        if not args.urls:
            raise ConfigError("give the tier URLs (top first) and --key or --prefix-of, or "
                              "--log FILE [--log FILE2]")
        if not args.key and not args.prefix_of:
            raise ConfigError("one of --key, --prefix-of or --log is required")
        if not args.timeout > 0:
            raise ConfigError(f"--timeout: expected seconds > 0, got {args.timeout}")
        keys = _keys(args)
    except (KVTierError, ValueError, TypeError) as exc:
        print(f"kvtier explain: {exc}")
        return 2
    return asyncio.run(_explain(args, keys))


def _compare_logs(args: argparse.Namespace) -> int:
    from kvtier.lookuplog import diff_logs, log_files, read_log

    try:
        if args.urls or len(args.log) > 2:
            raise ConfigError("--log: give one or two lookup logs (one per instance) and no "
                              "tier URLs")
        logs = [read_log(log_files(path)) for path in args.log]
    except KVTierError as exc:
        print(f"kvtier explain: {exc}")
        return 2
    found = diff_logs(logs[0], logs[1] if len(logs) == 2 else [])
    print(found.report() if len(args.log) == 2 else found.summary())
    return 0


async def _explain(args: argparse.Namespace, keys: list[bytes]) -> int:
    store = await _open(args)
    if isinstance(store, int):
        return store
    try:
        found = await store.explain(keys)
    finally:
        await store.aclose()
    if args.json:
        print(json.dumps([e.as_dict() for e in found], indent=2))
        return 0
    for explanation in found:
        print(explanation)
    hits = sum(e.hit for e in found)
    reasons: dict[str, int] = {}
    for e in found:
        if e.reason is not None:
            reasons[str(e.reason)] = reasons.get(str(e.reason), 0) + 1
    why = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
    line = f"{len(found)} keys: {hits} held, {len(found) - hits} missing" + \
        (f" ({why})" if why else "")
    if args.prefix_of:
        leading = next((i for i, e in enumerate(found) if not e.hit), len(found))
        line += f"; the prompt's first {leading} of {len(found)} blocks would hit"
    print(line)
    for reason in sorted(reasons):
        print(f"what to look at for {reason}: {REASON_HELP[MissReason(reason)].todo}")
    if reasons.get("not_stored"):
        print("note: this process opened the tiers afresh; evictions are recorded by the "
              "process that runs the store (its store.explain() and stats()['miss_reasons']).")
    return 0
