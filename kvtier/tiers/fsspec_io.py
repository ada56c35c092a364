"""Storage back ends of :class:`kvtier.tiers.fsspec.FsspecTier`.

Three ways to move a frame to and from a path:

- :class:`LocalBackend` for ``file://`` (POSIX mounts such as WEKA, VAST, NFS): plain ``os``
  calls in a worker thread (with ``nowait``, reads of cached files on the loop); a frame
  is written with one ``writev`` to a unique temp file in
  the target directory, then ``os.replace``-d into place, so a reader sees the old block, no
  block, or the whole new one.
- :class:`SyncFsBackend` for synchronous fsspec filesystems (``memory://``, ``sftp://``...):
  ``cat_file``/``pipe_file`` in a worker thread.
- :class:`AsyncFsBackend` for async fsspec filesystems (``s3://``, ``gs://``...): the
  coroutine API (``_cat_file``/``_pipe_file``) awaited on the running loop; one ``pipe``
  is one object PUT, which object stores publish atomically.

Every back end reports a missing object as ``None``/``False`` and lets other errors raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvtier.codec import FLAG_ZSTD, EncodedFrame, parse_header
from kvtier.deadline import in_thread
from kvtier.errors import CorruptBlockError
from kvtier.tiers.base import Block

__all__ = ["NOWAIT_MAX_BYTES", "AsyncFsBackend", "Backend", "LocalBackend", "SyncFsBackend",
           "close_async_fs"]

Decode = Callable[[Any], Block]
Encode = Callable[[], EncodedFrame]
Published = Callable[[], object] | None
# zstd/checksums of blocks above this size leave the event loop.
_INLINE_BYTES = 64 << 10
# ``nowait`` reads of files up to this size (a 4 MiB block and its header) may run on the
# loop (checksum included).
NOWAIT_MAX_BYTES = (4 << 20) + 4096
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class Backend(Protocol):
    """What the tier needs from a storage back end."""

    async def read(self, path: str, decode: Decode) -> Block | None:
        """Read and decode one object; ``None`` if it does not exist."""

    async def write(self, path: str, encode: Encode, published: Published = None) -> None:
        """Encode and publish one object atomically; call ``published`` as soon as it is in
        place (in the worker thread that wrote it, if any), so a write that fails or is cut
        short afterwards is still known to have stored the object."""

    async def delete(self, path: str, removed: Published = None) -> bool:
        """Remove one object; whether it existed. Call ``removed`` once it is gone (or was
        found absent), so a delete cut short afterwards is still known to have run."""

    async def exists(self, path: str) -> bool:
        """Whether the object exists."""

    async def close(self) -> None:
        """Release sessions."""


class LocalBackend:
    """POSIX files through ``os`` calls in worker threads.

    Parameters
    ----------
    fsync
        ``fsync`` each temp file before the rename, and its directory after (durable
        publish; slower).
    nowait
        Read on the event loop with ``preadv(..., RWF_NOWAIT)``, which reads only what is
        in the page cache: a file read whole that way (up to :data:`NOWAIT_MAX_BYTES`,
        uncompressed or small) costs no thread hop; any other falls back to a worker
        thread. ``open``/``fstat`` then also run on the loop, which is quick on a local
        disk with a warm directory tree but waits for the server on NFS: the tier turns it
        on for local filesystems only (``nowait=auto``, :mod:`kvtier.tiers.mounts`).
    """

    def __init__(self, *, fsync: bool = False, nowait: bool = False) -> None:
        self.fsync = fsync
        self.nowait = nowait and bool(_RWF_NOWAIT)
        self.reads_nowait = 0  # reads served on the loop
        self._dirs: set[str] = set()

    async def read(self, path: str, decode: Decode) -> Block | None:
        if self.nowait:
            try:
                return self._read_nowait(path, decode)
            except BlockingIOError:
                pass
        return await in_thread(self._read, path, decode, what="file read", wait_started=False)

    def _read_nowait(self, path: str, decode: Decode) -> Block | None:
        """Read and decode ``path`` on the calling thread from the page cache only.

        Raises
        ------
        BlockingIOError
            When part of the file is not cached, it is large, or decoding it is heavy
            (decompressing over ``_INLINE_BYTES``): read it in a thread.
        """
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > NOWAIT_MAX_BYTES:
                raise BlockingIOError(path)
            buf = np.empty(size, dtype=np.uint8)
            view = buf.data
            got = 0
            while got < size:
                try:
                    n = os.preadv(fd, [view[got:]], got, _RWF_NOWAIT)
                except OSError as exc:
                    if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                        self.nowait = False  # this filesystem has no RWF_NOWAIT reads
                        raise BlockingIOError(path) from exc
                    raise
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        try:
            head = parse_header(view[:got])
            heavy = bool(head.flags & FLAG_ZSTD) and head.raw_size > _INLINE_BYTES
        except CorruptBlockError:
            heavy = False  # decode raises it here, as the threaded path would
        if heavy:
            raise BlockingIOError(path)
        self.reads_nowait += 1
        return decode(view[:got])

    def _read(self, path: str, decode: Decode) -> Block | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            buf = np.empty(st.st_size, dtype=np.uint8)
            view = buf.data
            got = 0
            while got < st.st_size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            # No utime here: a read must work on a read-only mount and on files another
            # user wrote. The kernel's relatime keeps atime fresh enough for `kvtier gc`;
            # this node's own recency lives in the tier's policy.
        finally:
            os.close(fd)
        return decode(view[:got])

    async def write(self, path: str, encode: Encode, published: Published = None) -> None:
        await in_thread(self._write, path, encode, published, what="file write")

    def _write(self, path: str, encode: Encode, published: Published) -> None:
        frame = encode()
        directory, name = os.path.split(path)
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)
        # Unique per writer, in the same directory (rename is atomic only within one
        # filesystem); the leading dot keeps it out of the *.kvb namespace readers use.
        tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # directory removed by gc meanwhile
            self._dirs.discard(directory)
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                buffers = [memoryview(frame.header), frame.payload]
                while buffers:
                    n = os.writev(fd, buffers)
                    while buffers and n >= buffers[0].nbytes:
                        n -= buffers[0].nbytes
                        buffers.pop(0)
                    if buffers and n:
                        buffers[0] = buffers[0][n:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if published is not None:
            published()
        if self.fsync:
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    async def delete(self, path: str, removed: Published = None) -> bool:
        return await in_thread(self._delete, path, removed, what="file delete")

    @staticmethod
    def _delete(path: str, removed: Published) -> bool:
        return _remove(os.unlink, path, removed)

    async def exists(self, path: str) -> bool:
        return await in_thread(os.path.exists, path, what="file exists", wait_started=False)

    async def exists_many(self, paths: list[str]) -> list[bool]:
        """:meth:`exists` for many paths in one go: on the loop with ``nowait`` (a ``stat`` of
        a local file with a warm directory tree takes microseconds, far less than a thread
        hop per path), else in one worker thread."""
        if self.nowait:
            return self._exist(paths)
        return await in_thread(self._exist, paths, what="file exists", wait_started=False)

    @staticmethod
    def _exist(paths: list[str]) -> list[bool]:
        return [os.path.exists(path) for path in paths]

    async def close(self) -> None:
        self._dirs.clear()


class SyncFsBackend:
    """A synchronous fsspec filesystem, called from worker threads."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    async def read(self, path: str, decode: Decode) -> Block | None:
        return await in_thread(self._read, path, decode, what="fsspec read",
                               wait_started=False)

    def _read(self, path: str, decode: Decode) -> Block | None:
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return decode(data)

    async def write(self, path: str, encode: Encode, published: Published = None) -> None:
        await in_thread(self._write, path, encode, published, what="fsspec write")

    def _write(self, path: str, encode: Encode, published: Published) -> None:
        self.fs.pipe_file(path, encode().to_bytes())
        if published is not None:
            published()

    async def delete(self, path: str, removed: Published = None) -> bool:
        return await in_thread(self._delete, path, removed, what="fsspec delete")

    def _delete(self, path: str, removed: Published) -> bool:
        return _remove(self.fs.rm_file, path, removed)

    async def exists(self, path: str) -> bool:
        return bool(await asyncio.to_thread(self.fs.exists, path))

    async def close(self) -> None:
        """Nothing to release: sync filesystems hold no loop-bound session."""


class AsyncFsBackend:
    """An async fsspec filesystem (created with ``asynchronous=True`` on the running loop)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    async def read(self, path: str, decode: Decode) -> Block | None:
        try:
            data = await self.fs._cat_file(path)
        except FileNotFoundError:
            return None
        if len(data) > _INLINE_BYTES:
            return await in_thread(decode, data, what="fsspec decode", wait_started=False)
        return decode(data)

    async def write(self, path: str, encode: Encode, published: Published = None) -> None:
        # Encoding reads the caller's block: once started it is waited for.
        frame = await in_thread(encode, what="fsspec encode")
        await self.fs._pipe_file(path, frame.to_bytes())
        if published is not None:
            published()

    async def delete(self, path: str, removed: Published = None) -> bool:
        found = await self.fs._exists(path)
        if found:
            try:
                await self.fs._rm_file(path)
            except FileNotFoundError:
                found = False
        if removed is not None:
            removed()
        return bool(found)

    async def exists(self, path: str) -> bool:
        return bool(await self.fs._exists(path))

    async def close(self) -> None:
        await close_async_fs(self.fs)


async def close_async_fs(fs: Any) -> None:
    """Close the HTTP session an async fsspec filesystem opened on this loop."""
    creator = getattr(fs, "_s3creator", None)  # s3fs
    if creator is not None and hasattr(creator, "__aexit__"):
        await creator.__aexit__(None, None, None)
        return
    session = getattr(fs, "_session", None)  # http, gcsfs
    if session is not None and hasattr(session, "close"):
        result = session.close()
        if asyncio.iscoroutine(result):
            await result


def _remove(remove: Callable[[str], object], path: str, removed: Published) -> bool:
    """``remove(path)`` in a worker thread: whether the object existed; ``removed`` is
    called once it is gone (or was found absent)."""
    try:
        remove(path)
    except FileNotFoundError:
        found = False
    else:
        found = True
    if removed is not None:
        removed()
    return found
