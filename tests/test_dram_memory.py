"""The DRAM arena respects its container: the prefault's budget comes from the memory
cgroup (v1 and v2 files, and a real cgroup where this test may create one), the arena is
on transparent huge pages, the prefault populates the slots puts take next and stands
aside while puts fault their own, and ``aclose`` unmaps the arena without the cycle
collector."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import open_store
from kvtier.tiers import dram_arena
from kvtier.tiers.dram_arena import HostArena
from kvtier.tiers.host_memory import available_memory, cgroup_headroom

MiB = 1 << 20
GiB = 1 << 30


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_limit_minus_usage_and_the_tightest_ancestor(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    root = tmp_path / "fs"
    _write(root, {"cgroup.controllers": "cpu memory\n",
                  "kubepods/memory.max": "max\n", "kubepods/memory.current": "123\n",
                  "kubepods/pod1/memory.max": f"{2 * GiB}\n",
                  "kubepods/pod1/memory.current": f"{GiB}\n",
                  "kubepods/pod1/ctr/memory.max": f"{3 * GiB}\n",
                  "kubepods/pod1/ctr/memory.current": f"{100 * MiB}\n"})
    # The container's own limit leaves 2.9 GiB, its pod's only 1 GiB: the pod's binds.
    assert cgroup_headroom(proc, root) == GiB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   60000000 kB\n")
    assert available_memory(proc, root, meminfo) == GiB
    (root / "kubepods/pod1/memory.max").write_text("max\n")
    assert cgroup_headroom(proc, root) == 3 * GiB - 100 * MiB


def test_cgroup_v1_memory_controller_and_its_unlimited_value(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "fs"
    _write(root, {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                  "memory/docker/abc/memory.limit_in_bytes": f"{1536 * MiB}\n",
                  "memory/docker/abc/memory.usage_in_bytes": f"{36 * MiB}\n"})
    assert cgroup_headroom(proc, root) == 1500 * MiB
    (root / "memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_headroom(proc, root) is None  # v1's "no limit"
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   1024 kB\n")
    assert available_memory(proc, root, meminfo) == 1024 * 1024


def test_a_group_mounted_as_the_root_reads_the_mounts_own_files(tmp_path: Path) -> None:
    # A container with its own cgroup namespace sees its group as the mount's root, while
    # /proc/self/cgroup may still name a path that is not there.
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/ctr.scope\n")
    root = tmp_path / "fs"
    _write(root, {"cgroup.controllers": "memory\n", "memory.max": f"{GiB}\n",
                  "memory.current": f"{GiB + 5}\n"})
    assert cgroup_headroom(proc, root) == 0  # over its limit already: no room to prefault
    assert cgroup_headroom(tmp_path / "missing", root) is None


def test_no_cgroup_files_fall_back_to_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   2048 kB\n")
    assert available_memory(tmp_path / "none", tmp_path / "none", meminfo) == 2048 * 1024
    assert available_memory(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None


def _real_memory_cgroup() -> tuple[Path, str, str] | None:
    """A writable memory cgroup directory to create a child in: (parent, limit file,
    procs file), v2 first; ``None`` when this process may not create one."""
    groups = Path("/proc/self/cgroup").read_text().splitlines()
    for line in groups:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            mount = Path("/sys/fs/cgroup")
            if "memory" in (mount / "cgroup.controllers").read_text(errors="replace") \
                    if (mount / "cgroup.controllers").exists() else False:
                return mount / path.strip("/"), "memory.max", "cgroup.procs"
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.strip("/"), \
                "memory.limit_in_bytes", "cgroup.procs"
    return None


@pytest.fixture
def memory_cgroup() -> Iterator[tuple[Path, str]]:
    found = _real_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup here")
    parent, limit_file, _procs = found
    child = parent / f"kvtier-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        (child / limit_file).write_text(str(512 * MiB))
    except OSError as exc:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot create a memory cgroup here: {exc}")
    try:
        yield child, limit_file
    finally:
        child.rmdir()


_PREFAULT_CHILD = textwrap.dedent("""
    import asyncio, os, sys, time
    with open(sys.argv[1] + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    from kvtier import open_store

    async def main():
        store = await open_store(["dram://?capacity=1GiB"])
        arena = store.tiers[0].arena
        for _ in range(3000):
            if arena.stats()["prefaulted"]:
                break
            await asyncio.sleep(0.01)
        print(arena.stats()["prefaulted_bytes"], flush=True)
        await store.aclose()

    asyncio.run(main())
""")


@pytest.mark.slow
def test_a_1gib_arena_in_a_512mib_cgroup_prefaults_within_its_limit(
        memory_cgroup: tuple[Path, str]) -> None:
    child, _ = memory_cgroup
    done = subprocess.run([sys.executable, "-c", _PREFAULT_CHILD, str(child)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    # Before: the prefault took half of the host's MemAvailable, faulted all 1 GiB in, and
    # the kernel OOM-killed the process (returncode -9).
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    prefaulted = int(done.stdout.split()[-1])
    assert 0 < prefaulted <= 256 * MiB  # half of what the group allowed at open


def test_puts_ahead_of_the_prefault_fill_their_own_slots() -> None:
    arena = HostArena(256 * MiB, prefault="background")
    arena.stop_prefault()  # the thread's first chunk may still land; the puts are ahead
    try:
        slots = [arena.allocate(MiB) for _ in range(200)]
        for i, slot in enumerate(slots):
            assert slot is not None
            slot[:] = i % 251
        assert all(int(s[0]) == i % 251 for i, s in enumerate(slots) if s is not None)
    finally:
        del slots
        arena.close()


def test_a_put_past_the_prefault_on_4kib_pages_populates_its_slot_in_one_call() -> None:
    arena = HostArena(256 * MiB, prefault="background", hugepages=False)
    arena.stop_prefault()  # at most its first chunk lands: the later slots are past it
    slots = []
    try:
        while not arena.stats()["prefaulted"]:  # the thread's chunk in flight has landed
            time.sleep(0.001)
        slots = [arena.allocate(MiB) for _ in range(16)]
        # Mapped before anything is written (on huge pages the copy faults them instead).
        assert all(s is not None and all(_resident(arena, i * MiB, (i + 1) * MiB))
                   for i, s in enumerate(slots))
    finally:
        del slots
        arena.close()


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping holding ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                    reason="no transparent huge pages in this kernel")
@pytest.mark.parametrize(("query", "huge"), [("", True), ("&hugepages=0", False)])
async def test_the_arena_is_madvised_for_huge_pages_by_default(query: str, huge: bool) -> None:
    # With THP ``enabled=madvise`` (this box, and many distributions) an arena that is not
    # madvised gets 4 KiB pages: 512 faults per 2 MiB, and a fill at half the speed.
    store = await open_store([f"dram://?capacity=8MiB&prefault=0{query}"])
    try:
        arena = store.tiers[0].arena
        address = int(arena.buffer.__array_interface__["data"][0])
        assert ("hg" in _vm_flags(address)) is huge
        assert arena.stats()["hugepages"] is huge
    finally:
        await store.aclose()


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def _resident(arena: HostArena, start: int, end: int) -> list[bool]:
    """Whether each page of ``[start, end)`` of the arena is mapped (``mincore``)."""
    base = int(arena.buffer.__array_interface__["data"][0])
    pages = (end - start) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    assert _LIBC.mincore(base + start, end - start, vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec.raw]


def test_the_prefault_populates_the_slots_taken_next() -> None:
    arena = HostArena(256 * MiB, prefault="background", hugepages=False)
    slot = None
    try:
        while (done := arena.stats()["prefaulted_bytes"]) == 0:
            if arena.stats()["prefault_error"] is not None:
                pytest.skip(arena.stats()["prefault_error"])
            time.sleep(0.001)
        # Before: the thread walked down from the arena's end, so the first puts (carved
        # from the start) found unpopulated pages and raced it for the CPU.
        assert all(_resident(arena, 0, done))
        slot = arena.allocate(MiB)
        assert slot is not None and arena.offset_of(slot) == 0
    finally:
        del slot
        arena.close()


def test_the_prefault_stands_aside_while_puts_carve_and_skips_their_pages() -> None:
    arena = HostArena(64 * MiB, hugepages=False)  # no thread: the test takes its steps
    chunk = dram_arena.PREFAULT_CHUNK
    try:
        assert arena._populate_chunk(arena.nbytes) == 0.0  # [0, chunk)
        taken = [arena.allocate(MiB)]  # a populated slot: puts are carving
        pause = arena._populate_chunk(arena.nbytes)
        assert pause is not None and 0 < pause <= dram_arena.PREFAULT_PAUSE
        assert arena.stats()["prefaulted_bytes"] == chunk  # stood aside
        taken += [arena.allocate(MiB) for _ in range(chunk // MiB + 1)]  # two past it
        time.sleep(dram_arena.PREFAULT_PAUSE + 0.01)
        assert arena._populate_chunk(arena.nbytes) == 0.0
        top = chunk + 2 * MiB
        # The slots past it are left to the puts (never faulted twice over); the thread
        # goes on from the carve point.
        assert not any(_resident(arena, chunk, top))
        assert all(_resident(arena, top, top + chunk))
        assert arena.stats()["prefaulted_bytes"] == 2 * chunk
    finally:
        del taken
        arena.close()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_closed_stores_give_their_arena_back_without_the_cycle_collector() -> None:
    gc.collect()
    gc.disable()
    try:
        baseline = _rss()
        block = np.ones(MiB, np.uint8)
        for i in range(12):
            store = await open_store(["dram://?capacity=128MiB&prefault=1"])
            for k in range(8):
                await store.put(bytes([i, k]) * 8, block)
            await store.aclose()
            del store
        grown = _rss() - baseline
    finally:
        gc.enable()
    # Before: each closed store's 128 MiB arena stayed mapped until gc.collect()
    # (12 x 128 MiB = 1.5 GiB grown); now each is unmapped at aclose.
    assert grown < 200 * MiB, grown // MiB


async def test_a_readers_view_outlives_the_close_unchanged() -> None:
    store = await open_store(["dram://?capacity=16MiB&prefault=1"])
    await store.put(b"k" * 8, np.full(MiB, 7, np.uint8))
    got = await store.get(b"k" * 8)
    await store.aclose()
    assert got is not None and int(got.sum()) == 7 * MiB  # still mapped for the reader
