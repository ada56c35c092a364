"""``kvtier gc URL --capacity 10TiB``: trim a shared fsspec tier directory to a byte budget.

Several nodes may write one directory (``file:///mnt/weka/kvtier``, ``s3://bucket/kv``); each
node's ``capacity=`` only trims its own writes. This command is the operator's tool for the
whole directory (a ``file://...?fleet_capacity=SIZE`` tier runs the same gc in the
background). It lists every block file of the tier layout (``ab/cd/<hex>.kvb``), orders
them by last use and deletes the least recently used until the total fits. It also removes
temp files that writers left behind (a writer killed between create and rename) once they
are older than ``--tmp-age``. Nothing outside the layout is touched.

Last use, for ``file://``: the latest read any node logged under ``ROOT/.kvtier-uses``
(:mod:`kvtier.tiers.fleet_uses`) within ``--use-horizon``, else the modification time;
access times only with ``--use-atime`` (reads do not write them, and
``relatime``/``noatime`` mounts barely do).
The gc holds the directory's lease (:mod:`kvtier.tiers.fleet_lease`) while it runs, so two
gcs never trim one directory at once; a gc that finds the lease held says by whom and exits
0. Object stores (``s3://``...) have no use logs and no lease: blocks are ranked by their
last modification, and one operator runs the gc.

A ``file://`` pass that deleted blocks writes the directory's epoch marker, so running
tiers (``kvtier serve``) recheck what they hold and report what went in their KV events.
``lmdb:///DIR`` is one process's directory: the gc trims it itself when nobody has it open,
and otherwise asks the owner to trim itself and waits ``--wait`` seconds for its answer
(:mod:`kvtier.tiers.lmdb_gc`).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from kvtier.errors import ConfigError
from kvtier.redact import mask_secrets
from kvtier.tiers.fleet_gc import BLOCK_RE, TMP_RE, Entry, GcResult, collect_local, plan
from kvtier.tiers.fleet_lease import GcLease
from kvtier.urls import parse_size

NAME = "gc"
HELP = ("trim a shared file:// / s3:// tier directory to --capacity by least recent use "
        "(reads logged by the nodes, else modification time); file://: one gc per directory "
        "at a time (a lease), which nodes also run themselves with "
        "file://DIR?fleet_capacity=SIZE&gc_interval=SECONDS; lmdb://DIR: trimmed by its "
        "owner (kvtier serve) when one has it open")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier gc``."""
    parser.add_argument("url", metavar="URL",
                        help="tier URL (file:///mnt/weka/kvtier, s3://bucket/prefix?"
                             "endpoint_url=..., lmdb:///nvme/kvtier); kvtier options in it "
                             "are ignored")
    parser.add_argument("--capacity", required=True,
                        help="byte budget for the whole directory, e.g. 10TiB")
    parser.add_argument("--dry-run", action="store_true",
                        help="only report what would be deleted (takes no lease)")
    parser.add_argument("--tmp-age", type=float, default=3600.0, metavar="SECONDS",
                        help="delete writers' leftover temp files older than this (default 3600)")
    parser.add_argument("--use-horizon", type=float, default=7 * 86400.0, metavar="SECONDS",
                        help="file://: forget nodes' logged reads older than this (their "
                             "blocks rank by modification time; default 7 days)")
    parser.add_argument("--use-atime", action="store_true",
                        help="also count access times as use (only meaningful on strictatime "
                             "mounts; reads by kvtier are logged instead)")
    parser.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                        help="lmdb://: how long to wait for the process that has the "
                             "directory open to trim itself (default 60)")
    parser.add_argument("--lease-ttl", type=float, default=300.0, metavar="SECONDS",
                        help="file://: take over a gc lease not refreshed for this long "
                             "(its holder died; default 300)")


def _open(url: str) -> tuple[Any, str, bool]:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from kvtier.tiers.fsspec import FsspecTier

    # The tier's own URL parsing separates kvtier options from storage options.
    tier = FsspecTier.from_url(url, use_log=False)
    if tier.protocol in ("file", "local"):
        fs, root = fsspec.url_to_fs(tier.url)
    else:
        fs, root = fsspec.url_to_fs(tier.url, skip_instance_cache=True, **tier.storage_options)
    return fs, root, isinstance(fs, LocalFileSystem)


def _info_time(info: dict[str, Any]) -> float:
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
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


def _collect_fs(fs: Any, root: str, capacity: int, *, tmp_age: float,
                dry_run: bool) -> GcResult:
    entries = list(_scan_fs(fs, root))
    doomed, _ = plan(entries, capacity, now=time.time(), tmp_age=tmp_age)
    result = GcResult(files=len(entries), total=sum(e.size for e in entries))
    for entry in doomed:
        if not dry_run:
            try:
                fs.rm_file(entry.path)
            except FileNotFoundError:
                pass  # another node or gc got there first
            except OSError as exc:
                result.failed.append((entry.path, str(exc)))
                continue
        result.freed += entry.size
        result.deleted.append(entry.path)
    result.remaining = result.total - result.freed
    return result


def _collect_local(root: str, capacity: int, args: argparse.Namespace) -> GcResult | str:
    """The gc of a directory under its lease; the lease holder's description if taken."""
    if args.dry_run:
        return collect_local(root, capacity, None, tmp_age=args.tmp_age,
                             use_atime=args.use_atime, use_horizon=args.use_horizon,
                             dry_run=True)
    lease = GcLease(root, f"kvtier-gc@{socket.gethostname()}:{os.getpid()}",
                    ttl=args.lease_ttl)
    if not lease.acquire():
        seen = lease.last_seen
        return f"{seen.holder} (refreshed {seen.age:.0f} s ago)" if seen else "another gc"
    try:
        return collect_local(root, capacity, lease, tmp_age=args.tmp_age,
                             use_atime=args.use_atime, use_horizon=args.use_horizon)
    finally:
        lease.release()


def _gc_lmdb(args: argparse.Namespace, capacity: int) -> int:
    """Trim an LMDB directory: here when nobody has it open, else by its owner.

    Raises
    ------
    ConfigError
        When the URL names no LMDB environment, or with ``--dry-run``.
    """
    import asyncio

    from kvtier.errors import DirectoryLockedError
    from kvtier.tiers.lmdb import LMDBTier
    from kvtier.tiers.lmdb_gc import wait_answer, withdraw, write_request

    url = mask_secrets(args.url)
    if args.dry_run:
        raise ConfigError("--dry-run: not for lmdb:// (its blocks are evicted by their own "
                          "recency; kvtier stats shows what it holds)")
    if not args.wait > 0:
        raise ConfigError(f"--wait: expected > 0 seconds, got {args.wait}")
    path = LMDBTier.path_of_url(args.url)
    if not (path / "data.mdb").is_file():
        raise ConfigError(f"URL: {url!r}: no LMDB environment in {str(path)!r} (a typo? "
                          "give the directory the tier writes to)")
    try:
        tier = LMDBTier.from_url(args.url, watch=0)
    except DirectoryLockedError:
        request = write_request(path, capacity, f"kvtier-gc@{socket.gethostname()}:"
                                                f"{os.getpid()}")
        reply = wait_answer(path, request, args.wait)
        if reply is None:
            withdraw(path, request)
            print(f"kvtier gc {url}: the process that has it open did not answer within "
                  f"{args.wait:g} s (its tier needs watch= > 0, the default)")
            return 1
        print(f"kvtier gc {url}: trimmed by the process that has it open: deleted "
              f"{reply.get('deleted')} blocks ({reply.get('freed')} bytes); capacity "
              f"{capacity}; {reply.get('remaining')} bytes remain")
        return 0

    async def trim() -> tuple[int, int, int]:
        try:
            deleted, freed = await tier.trim(capacity)
            return deleted, freed, tier.used
        finally:
            await tier.aclose()

    deleted, freed, remaining = asyncio.run(trim())
    print(f"kvtier gc {url}: deleted {deleted} blocks ({freed} bytes); capacity {capacity}; "
          f"{remaining} bytes remain")
    return 0


def run(args: argparse.Namespace) -> int:
    """Scan, plan, delete (unless ``--dry-run``) and report."""
    try:
        capacity = parse_size(args.capacity, "--capacity")
        if not args.lease_ttl > 0:
            raise ConfigError(f"--lease-ttl: expected > 0 seconds, got {args.lease_ttl}")
        if not args.use_horizon > 0:
            raise ConfigError(f"--use-horizon: expected > 0 seconds, got {args.use_horizon}")
        if args.url.lower().startswith("lmdb:"):
            return _gc_lmdb(args, capacity)
        fs, root, local = _open(args.url)
        _check_listable(fs, root, local, args.url)
    except ConfigError as exc:
        print(f"kvtier gc: {exc}")
        return 2
    if local:
        try:
            outcome = _collect_local(root, capacity, args)
        except OSError as exc:  # the lease cannot be written: read-only or no permission
            print(f"kvtier gc: cannot take the gc lease in {root}: {exc}")
            return 2
        if isinstance(outcome, str):
            print(f"kvtier gc {mask_secrets(args.url)}: skipped, a gc is running: {outcome}")
            return 0
        result = outcome
    else:
        result = _collect_fs(fs, root, capacity, tmp_age=args.tmp_age, dry_run=args.dry_run)
    for path, error in result.failed:
        print(f"kvtier gc: cannot delete {path}: {error}")
    verb = "would delete" if args.dry_run else "deleted"
    print(f"kvtier gc {mask_secrets(args.url)}: {result.files} files, {result.total} bytes; "
          f"capacity {capacity}; "
          f"{verb} {len(result.deleted)} files ({result.freed} bytes); "
          f"{result.remaining} bytes remain"
          + (f"; {len(result.failed)} deletions failed" if result.failed else "")
          + ("; stopped: the gc lease was taken over" if result.lease_lost else ""))
    return 1 if result.failed or result.lease_lost else 0
