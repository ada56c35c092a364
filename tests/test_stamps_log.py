"""The stamps log: written by a worker thread in batches, as durable as the data tier, and
an index bounded in bytes whose dropped tombstones raise a floor (kvtier.peer.versions)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

from kvtier.commands.serve import versions_fsync
from kvtier.peer.stamplog import StampLog
from kvtier.peer.versions import Versions

KEY = b"\x07" * 16


async def test_the_loop_runs_while_the_log_cannot_be_written() -> None:
    # A pipe nobody reads fills at 64 KiB and then blocks every write, as a stalled disk
    # would: the old log called os.write on the loop, which then stopped for everyone.
    read_end, write_end = os.pipe()
    log = StampLog(write_end)
    log.append(b"x" * (1 << 20))
    committed = asyncio.ensure_future(log.commit())
    ticks = 0
    for _ in range(20):
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 20 and not committed.done()  # the loop ran; the commit still waits
    got = 0
    while got < 1 << 20:
        got += len(await asyncio.to_thread(os.read, read_end, 1 << 20))
    await committed
    await log.aclose()
    os.close(read_end)


async def test_commits_that_arrive_while_a_batch_is_written_share_the_next_one(
        tmp_path: Path) -> None:
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    log = StampLog(fd)
    writers: set[str] = set()
    real_write = log._write

    def spy(data: bytes) -> None:
        writers.add(threading.current_thread().name)
        real_write(data)

    log._write = spy  # type: ignore[method-assign]

    async def request(i: int) -> None:
        log.append(b"%04d" % i)
        await log.commit()

    await asyncio.gather(*(request(i) for i in range(200)))
    data = (tmp_path / "log").read_bytes()
    assert sorted(data[i:i + 4] for i in range(0, len(data), 4)) == \
        [b"%04d" % i for i in range(200)]
    assert log.batches < 200  # batched: fewer writes than requests
    assert writers and all(name.startswith("kvtier-stamps-log") for name in writers)
    await log.aclose()


def test_an_acknowledged_record_survives_the_process_being_killed(tmp_path: Path) -> None:
    path = tmp_path / "seg.versions"
    child = textwrap.dedent(f"""
        import asyncio, os
        from kvtier.peer.versions import Versions

        async def main() -> None:
            log = Versions({str(path)!r})
            for i in range(500):
                log.stored(i.to_bytes(16, "big"), 1000 + i)
                if i % 3 == 0:
                    log.deleted(i.to_bytes(16, "big"), 5000 + i)
                await log.commit()  # a write request is answered here
            print("acked", flush=True)
            os.kill(os.getpid(), 9)  # SIGKILL right after the last answer

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.strip() == "acked" and proc.returncode == -9, proc.stderr
    again = Versions(path)
    for i in range(500):
        key = i.to_bytes(16, "big")
        if i % 3 == 0:
            assert again.tombs[key][0] == 5000 + i and key not in again.stamps
        else:
            assert again.stamps[key] == 1000 + i
    again.close()


async def test_the_index_stays_within_its_bytes_and_dropped_tombstones_raise_a_floor(
        tmp_path: Path) -> None:
    path = tmp_path / "seg.versions"
    log = Versions(path, max_bytes=100_000)
    keys = [i.to_bytes(32, "big") for i in range(3000)]
    for i, key in enumerate(keys):
        log.stored(key, 10 + i)
        assert log.nbytes <= log.max_bytes
    # The oldest block stamps went first: their blocks are of unknown age now.
    assert keys[0] not in log.stamps and keys[-1] in log.stamps and log.floor == 0
    assert log.admits(keys[0], 1) is True  # unknown age loses to every stamp
    for i, key in enumerate(keys):
        log.deleted(key, 100_000 + i)
    assert not log.stamps and log.nbytes <= log.max_bytes and log.dropped > 3000
    gone = keys[0]  # its tombstone was dropped before its grace period ended
    assert gone not in log.tombs and log.floor >= 100_000
    assert log.admits(gone, 99) is False  # an older write can no longer undo the delete
    assert log.admits_fill(gone) is False  # nor a repair's fill
    assert log.admits(gone, log.floor + 1) is True  # a fresh client write lands
    floor = log.floor
    await log.aclose()
    again = Versions(path, max_bytes=100_000)
    assert again.floor == floor and again.admits(gone, 99) is False
    assert again.nbytes <= again.max_bytes
    again.close()


def test_the_byte_estimate_covers_the_memory_the_entries_take() -> None:
    tracemalloc.start()
    try:
        log = Versions(max_bytes=1 << 30)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            log.stored(os.urandom(32), (1 << 56) + i)
        for i in range(20_000):
            log.deleted(os.urandom(32), (1 << 57) + i)
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert taken <= log.nbytes * 1.1, (taken, log.nbytes)


async def test_without_wait_a_commit_hands_the_records_over_and_returns(tmp_path: Path) -> None:
    path = tmp_path / "seg.versions"
    log = Versions(path, wait=False)  # a volatile data tier (dram://)
    log.stored(KEY, 10)
    await log.commit()  # no thread hop awaited: the writer thread has the batch
    await log.aclose()  # which close writes out in any case
    again = Versions(path)
    assert again.stamps == {KEY: 10}
    again.close()


def test_the_log_is_fsynced_when_the_data_tier_fsyncs() -> None:
    def tiers(*urls: str) -> argparse.Namespace:
        return argparse.Namespace(tier=list(urls))

    assert versions_fsync(tiers("lmdb:///d?sync=1")) and versions_fsync(tiers("file:///d?fsync=1"))
    assert versions_fsync(tiers("dram://?capacity=1GiB", "lmdb:///d?capacity=1GiB&sync=meta"))
    assert not versions_fsync(tiers("lmdb:///d?capacity=1GiB"))
    assert not versions_fsync(tiers("file:///d")) and not versions_fsync(tiers("dram://"))


async def test_without_wait_a_stalled_log_holds_writes_back_past_its_backlog() -> None:
    read_end, write_end = os.pipe()  # a log nobody reads: stalled at 64 KiB
    log = Versions(wait=False)
    log._file = StampLog(write_end)  # the log of a volatile data tier, on a stalled disk
    for i in range(200):
        log.stored(i.to_bytes(16, "big"), 10 + i)
    await asyncio.wait_for(log.commit(), 5)  # a small backlog: handed over, no wait
    log._file.append(b"x" * (9 << 20))  # past the 8 MiB bound
    committed = asyncio.ensure_future(log.commit())
    await asyncio.sleep(0.2)
    assert not committed.done()  # the write waits for the log instead of growing its queue
    got = 0
    while got < (9 << 20) + 200 * 35:
        got += len(await asyncio.to_thread(os.read, read_end, 1 << 20))
    await committed
    await log.aclose()
    os.close(read_end)
