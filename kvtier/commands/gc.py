"""``kvtier gc URL --capacity 10TiB``: trim a shared fsspec tier directory to a byte budget.

Several nodes may write one directory (``file:///mnt/weka/kvtier``, ``s3://bucket/kv``); each
node's ``capacity=`` only trims its own writes. This command is the operator's tool for the
whole directory (a ``file://`` tier with ``fleet_capacity=`` runs the same in the
background): it lists every block file of the tier layout (``ab/cd/<hex>.kvb``), orders
them by last use and deletes the least recently used until the total fits. For
``file://`` a block's last use is the latest of its modification time, its access time and
the reads tiers logged under ``ROOT/.kvtier-use`` (:mod:`kvtier.tiers.uselog`): reads never
write file metadata, and relatime or noatime mounts would otherwise make a block age from
when it was written, so gc would evict hot blocks; logs older than ``--use-horizon`` are
deleted. Object stores rank by modification time. It also removes temp files that writers
left behind (a writer killed between create and rename) once they are older than
``--tmp-age``. Nothing outside the layout is touched (see :mod:`kvtier.tiers.fleetgc`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from typing import Any

from kvtier.errors import ConfigError
from kvtier.redact import mask_secrets
from kvtier.tiers.fleetgc import BLOCK_RE, TMP_RE, Entry, GcResult, collect_local, plan
from kvtier.urls import parse_size

NAME = "gc"
HELP = ("trim a shared file:// / s3:// tier directory to --capacity by least recent use "
        "(logged reads, access or modification time)")
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
        block = bool(BLOCK_RE.match(name))
        temp = bool(TMP_RE.match(name))
        if block or temp:
            yield Entry(path, int(info.get("size") or 0), _info_time(info), temp)


def _check_listable(fs: Any, root: str, local: bool, url: str) -> None:
    """Refuse a root that is not there: a typo must not read as "nothing to delete".

    Raises
    ------
    ConfigError
        When ``root`` is not a directory, or the store cannot be listed.
    """
    if local:
        if not os.path.isdir(root):
            raise ConfigError(f"URL: {mask_secrets(url)!r}: no directory {root!r} (a typo? "
                              "give the directory the tier writes to)")
        return
    try:
        fs.ls(root, detail=False)
    except FileNotFoundError:
        pass  # an empty prefix of an object store: nothing there yet
    except Exception as exc:  # a missing bucket, no or refused credentials (botocore's own)
        raise ConfigError(f"URL: cannot list {mask_secrets(url)!r}: {type(exc).__name__}: "
                          f"{exc}") from None


def _collect_fs(fs: Any, root: str, capacity: int, args: argparse.Namespace) -> GcResult:
    entries = list(_scan_fs(fs, root))
    doomed, remaining = plan(entries, capacity, now=time.time(), tmp_age=args.tmp_age)
    result = GcResult(files=len(entries), total=sum(e.size for e in entries),
                      remaining=remaining)
    for entry in doomed:
        if not args.dry_run:
            try:
                fs.rm_file(entry.path)
            except FileNotFoundError:
                pass  # another node or gc got there first
            except OSError as exc:
                result.failed.append((entry.path, str(exc)))
                continue
        result.freed += entry.size
        result.deleted.append(entry.path)
    return result


def run(args: argparse.Namespace) -> int:
    """Scan, plan, delete (unless ``--dry-run``) and report."""
    try:
        capacity = parse_size(args.capacity, "--capacity")
        fs, root, local = _open(args.url)
        _check_listable(fs, root, local, args.url)
    except ConfigError as exc:
        print(f"kvtier gc: {exc}")
        return 2
    if local:
        result = collect_local(root, capacity, tmp_age=args.tmp_age,
                               use_horizon=args.use_horizon, dry_run=args.dry_run)
    else:
        result = _collect_fs(fs, root, capacity, args)
    for path, error in result.failed:
        print(f"kvtier gc: cannot delete {path}: {error}")
    verb = "would delete" if args.dry_run else "deleted"
    print(f"kvtier gc {mask_secrets(args.url)}: {result.files} files, {result.total} bytes; "
          f"capacity {capacity}; {verb} {len(result.deleted)} files ({result.freed} bytes); "
          f"{result.remaining} bytes remain"
          + (f"; {len(result.failed)} deletions failed" if result.failed else ""))
    return 1 if result.failed else 0
