"""DNS changes that the members do not all see at once (issue 30): real `kvtier serve`
processes on loopback addresses 127.0.0.2-5, one port, ``peers+dns://`` over a name each
resolves through its own ``/etc/hosts`` (each server runs in a mount namespace of its own,
``unshare -m``, where a file of this test is bind-mounted over ``/etc/hosts``; the host's
is never touched), so the test decides which server sees a change when. After the change
every acknowledged key must end with ``replicas`` copies on its current owners, by
anti-entropy alone (nothing reads them), and none may be lost:

- a writer that keeps the old member list (a client that has not re-resolved yet) puts
  keys on their old owners after every server's pass for the change has run;
- a member that has not seen a leave yet drops its stand-in copy of keys it will own,
  after their other owner's pass found the copy there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from kvtier.peer.ring import HashRing
from kvtier.peer.tier import PeerTier
from kvtier.testing.conformance import key_of, sample_block
from tests.helpers.peer_helpers import AUTH, ServeProcess, pool_url, token_file

# Long-running (real server processes, fault schedules, crashes): the system lane, run by
# `python -m pytest -q -m slow` (CI runs it after the default run).
pytestmark = pytest.mark.slow

NAME = "kvtpool"
ADDRESSES = [f"127.0.0.{n}" for n in range(2, 6)]  # A, B, C, D (served)
NEVER_UP = "127.0.0.6"  # E: named by DNS for one member, never started
SLOT = 40  # bytes per hosts-file line: every rewrite is the same size, one write
KEYS = 96
_COUNTER = re.compile(r"^kvtier_peer_repair_(\w+)_total (\S+)$", re.M)


class Hosts:
    """The hosts file the servers resolve ``NAME`` through, rewritten in place (the bind
    mount holds its inode) with one write of a fixed size, so a resolver never reads half
    of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(b"")

    def set(self, addresses: list[str]) -> None:
        lines = [f"{a} {NAME}" for a in addresses] + ["#"] * (len(ADDRESSES) + 1
                                                               - len(addresses))
        data = "".join(line.ljust(SLOT - 1) + "\n" for line in lines).encode()
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)


def _namespace_prefix(hosts: Path) -> list[str] | str:
    """The command prefix that runs a process with ``hosts`` as its ``/etc/hosts``, or why
    none works here."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    why = ""
    for flags in (["-m"], ["-r", "-m"]):  # root, else a user namespace of its own
        prefix = ["unshare", *flags, "sh", "-c", script, str(hosts)]
        probe = subprocess.run([*prefix, "getent", "hosts", NAME], capture_output=True,
                               text=True, timeout=30)
        if probe.returncode == 0 and ADDRESSES[0] in probe.stdout:
            return prefix
        why = probe.stderr.strip() or f"exit {probe.returncode}"
    return f"cannot bind-mount a hosts file in a mount namespace: {why}"


def _one_free_port() -> int:
    """A port free on every address of :data:`ADDRESSES` now."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((ADDRESSES[0], 0))
            port = int(first.getsockname()[1])
            try:
                for address in ADDRESSES[1:]:
                    stack.enter_context(socket.socket()).bind((address, port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on every loopback address")


@contextlib.contextmanager
def _servers(tmp: Path, prefixes: list[list[str]], port: int) -> Iterator[list[ServeProcess]]:
    """A ``kvtier serve`` on each of :data:`ADDRESSES` (each run under its prefix)."""
    tokens = token_file(tmp)
    url = (f"peers+dns://{NAME}:{port}?replicas=2&token=file:{tokens}&timeout=2"
           "&dns_interval=0.2&health_interval=0.2")
    procs = [ServeProcess(["--tier", "dram://", "--pool", url, "--repair-interval", "0.5"],
                          tokens, prefix=prefix) for prefix in prefixes]
    try:
        for proc, address in zip(procs, ADDRESSES, strict=True):
            proc.launch(f"{address}:{port}")
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


async def _counter(http: aiohttp.ClientSession, member: str, name: str = "passes") -> int:
    """One of ``member``'s anti-entropy counters, from its ``/metrics``."""
    async with http.get(f"http://{member}/metrics",
                        timeout=aiohttp.ClientTimeout(total=10)) as answer:
        found = dict(_COUNTER.findall(await answer.text()))
    return int(float(found.get(name, 0)))


async def _counters(http: aiohttp.ClientSession, member: str) -> dict[str, str]:
    """``member``'s anti-entropy counters (for a failure's message)."""
    async with http.get(f"http://{member}/metrics",
                        timeout=aiohttp.ClientTimeout(total=10)) as answer:
        return dict(_COUNTER.findall(await answer.text()))


async def _until_passed(http: aiohttp.ClientSession, before: dict[str, int]) -> None:
    """Until each member of ``before`` has run a pass past its count there."""
    for member, passes in before.items():
        for _ in range(600):
            if await _counter(http, member) > passes:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{member} never ran a pass after the change")


async def _settle(members: list[str], keys: list[bytes]) -> list[int]:
    """The counts of :func:`_under_replicated` over ``members``, looked at until 0 (or
    300 looks: the servers' repair interval is 0.5 s, so 0 comes within a few)."""
    async with PeerTier.from_url(pool_url(members, replicas=2)) as checker:
        await checker.open()
        under = [await _under_replicated(checker, keys)]
        while under[-1] and len(under) < 300:
            await asyncio.sleep(0.1)
            under.append(await _under_replicated(checker, keys))
    return under


async def _lost(members: list[str], keys: list[bytes]) -> int:
    """How many of ``keys`` (``key_of(i)`` each) do not read back right from ``members``."""
    async with PeerTier.from_url(pool_url(members, replicas=2)) as fresh:
        got = await fresh.get_many(keys)
    return sum(1 for key, block in zip(keys, got, strict=True)
               if block is None or not np.array_equal(block, sample_block(_index[key])))


_index = {key_of(i): i for i in range(4000)}


async def _quiet(http: aiohttp.ClientSession, members: list[str]) -> dict[str, int]:
    """Each member's anti-entropy pass count, once every member has run a pass and none
    ran another over three looks (the start-up's health changes are over)."""
    seen: list[dict[str, int]] = []
    for _ in range(600):
        seen.append({m: await _counter(http, m) for m in members})
        if len(seen) >= 3 and all(seen[-1].values()) and seen[-1] == seen[-2] == seen[-3]:
            return seen[-1]
        await asyncio.sleep(0.2)
    raise AssertionError(f"the pool never went quiet: {seen[-3:]}")


async def _under_replicated(tier: PeerTier, keys: list[bytes]) -> int:
    """How many of ``keys`` fewer than 2 of their owners on the ring of ``tier``'s members
    hold, asking each member directly (no read: no read repair)."""
    members = list(tier.members.members)
    held = {m: await asyncio.wait_for(tier.members.client(m).exists_many(keys), 10)
            for m in members}
    return sum(1 for i, key in enumerate(keys)
               if sum(held[m][i] for m in tier.members.ring.owners(key, 2)) < 2)


def _setup(tmp: Path) -> tuple[list[Hosts], list[list[str]], int, list[str]]:
    """Each server's hosts file (naming A, B, C, D) and command prefix, the port, and the
    member ids ``A, B, C, D, E``; skips where no mount namespace can be made."""
    hosts = [Hosts(tmp / f"hosts-{n}") for n in range(len(ADDRESSES))]
    for one in hosts:
        one.set(ADDRESSES)
    prefixes = []
    for one in hosts:
        prefix = _namespace_prefix(one.path)
        if isinstance(prefix, str):
            pytest.skip(prefix)
        prefixes.append(prefix)
    port = _one_free_port()
    members = [f"{address}:{port}" for address in [*ADDRESSES, NEVER_UP]]
    return hosts, prefixes, port, members


async def test_puts_from_a_writer_behind_a_dns_swap_reach_the_new_owners(
        tmp_path: Path) -> None:
    """DNS swaps C for D; once every server's pass for the swap has run, a writer still on
    the old list puts 96 keys (on their old owners: C for some, and none on D), and C stops.
    Anti-entropy alone must put every key on both of its new owners (before the fix none
    checked those keys again: they stayed on one owner), and every key reads back."""
    hosts, prefixes, port, (a, b, c, d, _) = _setup(tmp_path)
    for one in hosts:
        one.set(ADDRESSES[:3])
    old, new = [a, b, c], [a, b, d]
    keys = [key_of(i) for i in range(KEYS)]
    before_ring, after_ring = HashRing(old), HashRing(new)
    moved = [k for k in keys if set(before_ring.owners(k, 2)) != set(after_ring.owners(k, 2))]
    assert len(moved) > KEYS // 4  # the swap moves keys off C and onto D
    with _servers(tmp_path, prefixes, port) as procs:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            before = await _quiet(http, [*old, d])
            for one in hosts:
                one.set([ADDRESSES[0], ADDRESSES[1], ADDRESSES[3]])  # C out, D in
            await _until_passed(http, before)  # each has seen the swap and run its pass
        stale = PeerTier.from_url(pool_url(old, replicas=2, ack="all"))
        async with stale:
            await stale.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
        procs[2].stop()  # C
        under = await _settle(new, moved)
        assert under[-1] == 0, (
            f"{under[-1]} of {len(moved)} keys the swap moved still on fewer than 2 of "
            f"their owners after {len(under)} looks (first {under[0]})")
        assert await _lost(new, keys) == 0


async def test_a_standin_dropped_by_a_member_behind_a_leave_is_pushed_back(
        tmp_path: Path) -> None:
    """Keys owned by A and D, with a stand-in copy on C; D leaves DNS. A sees it first and
    runs its pass: the keys' owners are now A and C, and C holds them. C, still on the old
    ring, then runs a pass (DNS names a member E for C alone, which moves none of these
    keys) and drops its copies as spare stand-ins (A and D hold them). Then C and D see
    the leave and D stops. A's keys must get back to C by anti-entropy alone (before the
    fix A never checked them again: they stayed on A alone, one failure from loss)."""
    hosts, prefixes, port, (a, b, c, d, e) = _setup(tmp_path)
    old, new, c_view = [a, b, c, d], [a, b, c], [a, b, c, d, e]
    rings = [HashRing(old), HashRing(c_view), HashRing(new)]
    keys = [k for k in map(key_of, range(4000))
            if [set(ring.owners(k, 2)) for ring in rings] == [{a, d}, {a, d}, {a, c}]][:24]
    assert len(keys) == 24
    blocks = [(k, sample_block(_index[k])) for k in keys]
    with _servers(tmp_path, prefixes, port) as procs:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            before = await _quiet(http, old)
            # One put, one stamp: on both owners and on C (a stand-in copy, as a put or a
            # read repair while an owner was down leaves one).
            async with PeerTier.from_url(pool_url([a, c, d], replicas=3, ack="all")) as put:
                await put.put_many(blocks)
            for one in hosts[:2]:  # A and B see D leave
                one.set(ADDRESSES[:3])
            await _until_passed(http, {m: before[m] for m in (a, b)})
            pruned = await _counter(http, c, "standins_pruned")
            hosts[2].set([*ADDRESSES, NEVER_UP])  # C, still with D, sees E join
            for _ in range(100):
                if await _counter(http, c, "standins_pruned") >= pruned + len(keys):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"C never dropped its stand-ins: {await _counters(http, c)}")
            passes = await _counter(http, c)
            for one in hosts[2:]:  # C and D see D leave (and E go)
                one.set(ADDRESSES[:3])
            await _until_passed(http, {c: passes})
            procs[3].stop()  # D
            under = await _settle(new, keys)
            assert under[-1] == 0, (
                f"{under[-1]} of {len(keys)} keys still on fewer than 2 of their owners after "
                f"{len(under)} looks (first {under[0]}); A: {await _counters(http, a)}, "
                f"C: {await _counters(http, c)}\n" + "".join(p.output()[-1500:] for p in procs))
        assert await _lost(new, keys) == 0


async def test_a_member_that_leaves_dns_hands_over_what_only_it_holds(
        tmp_path: Path) -> None:
    """C alone holds some keys (a put with ``replicas=1`` onto it) when DNS stops naming it:
    C must see that it left (before the fix it kept itself in its own ring, saw no change
    and handed nothing over), and its pass puts each key on its owners A and B."""
    hosts, prefixes, port, (a, b, c, _, _) = _setup(tmp_path)
    for one in hosts:
        one.set(ADDRESSES[:3])
    keys = [key_of(i) for i in range(24)]
    with _servers(tmp_path, prefixes, port) as procs:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            before = await _quiet(http, [a, b, c])
            async with PeerTier.from_url(pool_url([c], replicas=1)) as only_c:
                await only_c.put_many([(k, sample_block(i)) for i, k in enumerate(keys)])
            for one in hosts:
                one.set(ADDRESSES[:2])  # C leaves DNS (it keeps running)
            await _until_passed(http, {c: before[c]})
            under = await _settle([a, b], keys)
            assert under[-1] == 0, (
                f"{under[-1]} of {len(keys)} keys still on fewer than 2 of their owners after "
                f"{len(under)} looks (first {under[0]}); C: {await _counters(http, c)}")
        procs[2].stop()
        assert await _lost([a, b], keys) == 0
