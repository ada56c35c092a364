"""``kvtier gc URL --capacity 10TiB``: trim a shared fsspec tier directory to a byte budget.

Several nodes may write one directory (``file:///mnt/weka/kvtier``, ``s3://bucket/kv``); each
node's ``capacity=`` only trims its own writes. This command is the operator's tool for the
whole directory: it lists every block file of the tier layout (``ab/cd/<hex>.kvb``), orders
them by last use and deletes the least recently used until the total fits. A block's last
use is the latest of its modification time, its access time and the reads ``file://`` tiers
logged under ``ROOT/.kvtier-use`` (:mod:`kvtier.tiers.uselog`): reads never write file
metadata, and relatime or noatime mounts would otherwise make a block age from when it was
written, so gc would evict hot blocks. Use logs older than ``--use-horizon`` are deleted.
It also
removes temp files that writers left behind (a writer killed between create and rename)
once they are older than ``--tmp-age``. Nothing outside the layout is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.redact import mask_secrets
from kvtier.tiers.fsspec import BLOCK_SUFFIX
from kvtier.tiers.uselog import read_uses, stale_logs
from kvtier.urls import parse_size

NAME = "gc"
HELP = ("trim a shared file:// / s3:// tier directory to --capacity by least recent use "
        "(last access or modification time)")

_BLOCK_RE = re.compile(r"^(?:[0-9a-f]{2,200}|h[0-9a-f]{64})" + re.escape(BLOCK_SUFFIX) + "$")
_TMP_RE = re.compile(r"^\..+" + re.escape(BLOCK_SUFFIX) + r"\.[0-9a-f]{32}\.tmp$")


@dataclass(frozen=True)
class Entry:
    """One file under the tier root."""

    path: str
    size: int
    last_use: float
    temp: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier gc``."""
    parser.add_argument("url", metavar="URL",
                        help="tier URL (file:///mnt/weka/kvtier, s3://bucket/prefix?"
                             "endpoint_url=...); kvtier options in it are ignored")
    parser.add_argument("--capacity", required=True,
                        help="byte budget for the whole directory, e.g. 10TiB")
    parser.add_argument("--dry-run", action="store_true",
                        help="only report what would be deleted")
    parser.add_argument("--tmp-age", type=float, default=3600.0, metavar="SECONDS",
                        help="delete writers' leftover temp files older than this (default 3600)")
    parser.add_argument("--use-horizon", type=float, default=7 * 86400.0, metavar="SECONDS",
                        help="file://: delete nodes' read logs older than this (default 7 days)")


def _open(url: str) -> tuple[Any, str, bool]:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from kvtier.tiers.fsspec import FsspecTier

    # The tier's own URL parsing separates kvtier options from storage options.
    tier = FsspecTier.from_url(url)
    if tier.protocol in ("file", "local"):
        fs, root = fsspec.url_to_fs(tier.url)
    else:
        fs, root = fsspec.url_to_fs(tier.url, skip_instance_cache=True, **tier.storage_options)
    return fs, root, isinstance(fs, LocalFileSystem)


def _scan_local(root: str) -> Iterator[Entry]:
    uses = read_uses(root)
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for item in it:
                    if item.is_dir(follow_symlinks=False):
                        stack.append(item.path)
                    elif item.is_file(follow_symlinks=False):
                        block = bool(_BLOCK_RE.match(item.name))
                        temp = bool(_TMP_RE.match(item.name))
                        if block or temp:
                            st = item.stat(follow_symlinks=False)
                            last = max(st.st_atime, st.st_mtime, uses.get(item.name, 0.0))
                            yield Entry(item.path, st.st_size, last, temp)
        except FileNotFoundError:
            continue  # removed concurrently


def _info_time(info: dict[str, Any]) -> float:
    for field in ("atime", "mtime", "LastModified", "last_modified", "created"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0


def _scan_fs(fs: Any, root: str) -> Iterator[Entry]:
    found = fs.find(root, detail=True)
    for path, info in found.items():
        name = path.rsplit("/", 1)[-1]
        block = bool(_BLOCK_RE.match(name))
        temp = bool(_TMP_RE.match(name))
        if block or temp:
            yield Entry(path, int(info.get("size") or 0), _info_time(info), temp)


def _scan(fs: Any, root: str, local: bool, url: str) -> list[Entry]:
    """Every block and temp file under ``root``.

    Raises
    ------
    ConfigError
        When ``root`` is not a directory (a typo must not read as "nothing to delete") or
        the store cannot be listed.
    """
    if local:
        if not os.path.isdir(root):
            raise ConfigError(f"URL: {mask_secrets(url)!r}: no directory {root!r} (a typo? "
                              "give the directory the tier writes to)")
        return list(_scan_local(root))
    try:
        return list(_scan_fs(fs, root))
    except Exception as exc:  # a missing bucket, no or refused credentials (botocore's own)
        raise ConfigError(f"URL: cannot list {mask_secrets(url)!r}: {type(exc).__name__}: "
                          f"{exc}") from None


def plan(entries: list[Entry], capacity: int, *, now: float,
         tmp_age: float) -> tuple[list[Entry], int]:
    """Entries to delete (stale temp files, then least recently used blocks) and the bytes
    that remain."""
    doomed = [e for e in entries if e.temp and now - e.last_use > tmp_age]
    blocks = sorted((e for e in entries if not e.temp), key=lambda e: e.last_use)
    total = sum(e.size for e in entries) - sum(e.size for e in doomed)
    for entry in blocks:
        if total <= capacity:
            break
        doomed.append(entry)
        total -= entry.size
    return doomed, total


def run(args: argparse.Namespace) -> int:
    """Scan, plan, delete (unless ``--dry-run``) and report."""
    try:
        capacity = parse_size(args.capacity, "--capacity")
        fs, root, local = _open(args.url)
        entries = _scan(fs, root, local, args.url)
    except ConfigError as exc:
        print(f"kvtier gc: {exc}")
        return 2
    total = sum(e.size for e in entries)
    doomed, remaining = plan(entries, capacity, now=time.time(), tmp_age=args.tmp_age)
    freed = deleted = failed = 0
    if local and not args.dry_run:
        for path in stale_logs(root, time.time(), args.use_horizon):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for entry in doomed:
        if args.dry_run:
            freed += entry.size
            deleted += 1
            continue
        try:
            if local:
                os.unlink(entry.path)
            else:
                fs.rm_file(entry.path)
        except FileNotFoundError:
            pass  # another node or gc got there first
        except OSError as exc:
            failed += 1
            print(f"kvtier gc: cannot delete {entry.path}: {exc}")
            continue
        freed += entry.size
        deleted += 1
    verb = "would delete" if args.dry_run else "deleted"
    print(f"kvtier gc {mask_secrets(args.url)}: {len(entries)} files, {total} bytes; "
          f"capacity {capacity}; "
          f"{verb} {deleted} files ({freed} bytes); {remaining} bytes remain"
          + (f"; {failed} deletions failed" if failed else ""))
    return 1 if failed else 0
