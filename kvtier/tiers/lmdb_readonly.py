"""An ``lmdb://`` directory opened for reading only: what ``kvtier explain`` looks through.

:class:`~kvtier.tiers.lmdb.LMDBTier` owns its directory: it creates it, takes
``kvtier.lock``, writes the open marker and opens its databases in a write transaction. A
tool that only looks must do none of that, and must work beside the process that owns the
directory (a running ``kvtier serve``). :class:`ReadOnlyLMDBTier`:

- refuses a path with no environment (:class:`~kvtier.errors.ConfigError`: no directory
  or no ``data.mdb`` is created for a typo);
- opens the environment read-only; when a process owns the directory (its ``kvtier.lock``
  is locked) it reads with LMDB's reader lock (a slot of the owner's ``lock.mdb`` reader
  table, which LMDB needs to keep the pages it reads from being reused under it), and
  otherwise without it, so not a byte of the directory changes;
- answers ``contains`` and ``get`` from the stored frames, and refuses writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import lmdb

from kvtier.errors import ConfigError, CorruptBlockError, TierError
from kvtier.tiers.base import Block, Tier
from kvtier.tiers.lmdb import LMDBTier
from kvtier.tiers.lmdb_env import BlockEnv
from kvtier.urls import parse_tier_url

__all__ = ["ReadOnlyLMDBTier", "owned"]

_LOCK_NAME = "kvtier.lock"  # kvtier.tiers.lmdb_dir's lock file
_READ_MAP_SIZE = 10 << 20  # LMDB maps at least the size the environment records


def owned(path: Path) -> bool:
    """Whether a process holds the directory's ``kvtier.lock`` (it has the tier open).
    Tests the lock with a shared, non-blocking ``flock`` on a read-only descriptor, which
    changes nothing on disk."""
    try:
        fd = os.open(path / _LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class ReadOnlyLMDBTier(Tier):
    """The blocks of an existing LMDB directory, read-only (see the module docstring).

    Parameters
    ----------
    path
        The directory of ``data.mdb``.
    name
        Label in stats and output.
    """

    scheme = "lmdb"
    persistent = True

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None) -> None:
        super().__init__(name=name)
        self.path = Path(path)
        self._env: BlockEnv | None = None
        self._used = 0
        self.owned = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Self:
        """``lmdb:///DIR?name=LABEL`` (the other options are the writer's and do not change
        reading)."""
        name = options.get("name", parse_tier_url(url).params.get("name"))
        return cls(LMDBTier.path_of_url(url), name=str(name) if name is not None else None)

    async def open(self) -> None:
        """Open the environment for reading.

        Raises
        ------
        ConfigError
            When the directory holds no LMDB environment, or LMDB cannot read it.
        """
        if self._env is None:
            self._env = await asyncio.to_thread(self._open_env)

    def _open_env(self) -> BlockEnv:
        if not (self.path / "data.mdb").is_file():
            raise ConfigError(f"path: no LMDB environment in {str(self.path)!r} (nothing was "
                              "stored there, or a typo: give the directory the tier writes to)")
        self.owned = owned(self.path)
        try:
            env = BlockEnv(self.path, map_size=_READ_MAP_SIZE, read_only=True, lock=self.owned)
        except lmdb.Error as exc:
            raise ConfigError(f"path: LMDB cannot read {str(self.path)!r}: {exc}") from exc
        self._used = sum(size for _key, size, _last in env.load_index())
        return env

    def _live_env(self) -> BlockEnv:
        if self._env is None:
            raise TierError(f"lmdb tier {self.name}: not open (await tier.open() first)")
        return self._env

    @property
    def capacity(self) -> int | None:
        return None

    @property
    def used(self) -> int:
        """Frame bytes stored when the tier was opened."""
        return self._used

    async def _get(self, key: bytes) -> Block | None:
        env = self._live_env()
        (found,) = await asyncio.to_thread(env.read, [key])
        if isinstance(found, CorruptBlockError):
            return None  # a miss; the owner deletes it at its own next read
        return found

    async def _contains(self, key: bytes) -> bool:
        return (await self._contains_many([key]))[0]

    async def _contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        env = self._live_env()
        return await asyncio.to_thread(env.contains, list(keys))

    async def _put(self, key: bytes, block: Block) -> None:
        raise TierError(f"lmdb tier {self.name}: opened read-only")

    async def _delete(self, key: bytes) -> bool:
        raise TierError(f"lmdb tier {self.name}: opened read-only")

    async def _aclose(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            with contextlib.suppress(lmdb.Error):
                await asyncio.to_thread(env.close)
