"""The stamps log's file, written off the event loop (see :mod:`kvtier.peer.versions`).

The loop only appends a record's bytes to the batch being built (no system call); one
writer thread writes whole batches, so the records of every write request that arrives
while a batch is being written go out together in the next ``os.write`` (a group commit).
At most one batch is being written and one being built at any time: that is the writer's
whole queue, and it is bounded because a write request waits for its records
(:meth:`StampLog.commit`) before it is answered (without ``Versions(wait=)``: once the
log owes more than a few MiB), and the server bounds the requests in flight.

Durability, as the data tier's: with a persistent data tier a write request is answered
only once its records are in the file (``os.write`` returned: the page cache holds them),
so a server process killed after the answer loses no acknowledged stamp or tombstone, as
an LMDB commit without fsync loses nothing to a process crash. (With a volatile one,
``dram://`` only, the answer does not wait: a crash loses those blocks anyway, and the
records follow within one batch; see ``Versions(wait=)``.) With ``fsync`` (the data tier
fsyncs its writes: ``lmdb://...?sync=1|meta``, ``file://...?fsync=1``) each batch is also
fsynced before its requests are answered, so an OS crash loses no acknowledged record
either; without it an OS crash may lose the log's tail, as it may lose the data tier's
last commits. A record cut short by a crash is dropped at the next open; the ones before
it stand.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

__all__ = ["StampLog"]


class StampLog:
    """An append-only file whose writes run in one worker thread, batched.

    Parameters
    ----------
    fd
        The file, opened for appending (this object closes it).
    fsync
        Whether each batch is fsynced before its writers are told it is written.
    """

    def __init__(self, fd: int, *, fsync: bool = False) -> None:
        self._fd: int | None = fd
        self.fsync = fsync
        self.batches = 0  # batches written (each one os.write, and one fsync with fsync)
        self._building = bytearray()
        self._waiting: list[asyncio.Future[None]] = []  # commits of the batch being built
        self._writing: concurrent.futures.Future[None] | None = None
        self._writing_bytes = 0
        self._written: list[asyncio.Future[None]] = []  # commits of the batch being written
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-stamps-log")

    @property
    def backlog(self) -> int:
        """Bytes appended and not yet written (the batch being built and the one being
        written)."""
        return len(self._building) + self._writing_bytes

    def append(self, record: bytes) -> None:
        """Add ``record`` to the batch being built (on the loop: no system call)."""
        self._building += record

    def flush(self) -> None:
        """Hand the batch being built to the writer thread unless it is busy (its next
        batch then takes it); never waits. Outside an event loop the batch is written
        inline."""
        if self._writing is not None or not self._building or self._fd is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write(self._take())
            return
        data, waiters = self._take(), self._waiting
        self._waiting = []
        self._written = waiters
        self._writing_bytes = len(data)
        self._writing = self._thread.submit(self._write, data)
        self._writing.add_done_callback(
            lambda done: loop.call_soon_threadsafe(self._batch_done, done))

    async def commit(self) -> None:
        """Return once every record appended so far is in the file (and fsynced, with
        ``fsync``).

        Raises
        ------
        OSError
            If writing the batch holding them failed (a full disk): the records are lost
            and the write request that made them fails.
        """
        if self._building:
            waiters = self._waiting
        elif self._writing is not None:
            waiters = self._written
        else:
            return  # nothing appended that is not written already: no hop
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(done)
        self.flush()
        await done

    def _take(self) -> bytes:
        data = bytes(self._building)
        self._building.clear()
        return data

    def _write(self, data: bytes) -> None:
        """In the writer thread: the whole batch, then fsync if asked."""
        fd = self._fd
        if fd is None:
            raise OSError("the stamps log is closed")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if self.fsync:
            os.fsync(fd)
        self.batches += 1

    def _batch_done(self, done: concurrent.futures.Future[None]) -> None:
        waiters, self._written, self._writing = self._written, [], None
        self._writing_bytes = 0
        error = done.exception()
        for waiter in waiters:
            if waiter.done():
                continue  # its request was cancelled meanwhile
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(OSError(f"stamps log write failed: {error}"))
        self.flush()  # what was appended meanwhile: the next batch

    async def aclose(self) -> None:
        """Write what is pending, stop the writer thread and close the file."""
        while self._building or self._writing is not None:
            await self.commit()
        self.close()

    def close(self) -> None:
        """As :meth:`aclose`, blocking: waits for the batch being written, writes the one
        being built inline. Calling it again does nothing."""
        self._thread.shutdown(wait=True)
        if self._fd is None:
            return
        if self._building:
            self._write(self._take())
        os.close(self._fd)
        self._fd = None
