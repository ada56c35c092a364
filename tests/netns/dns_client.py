"""The client of the netns lane: one ``peers+dns://`` tier, a writer and 8 readers.

Run inside the client's namespace as ``python tests/netns/dns_client.py NAME PORT TOKEN_FILE``.
It prints ``{"ready": ...}`` once the tier resolved its members, then obeys one command per
stdin line and answers each with one JSON line on stdout:

- ``phase NAME READS MEMBERS``: the writer puts blocks (``ack=all``) while 8 readers each
  read ``READS`` batches of 16 acknowledged keys, and keep reading until the tier's member
  set is ``MEMBERS`` (comma-separated ids) and a batch found every key, so a membership
  change or partition the lane makes right after sending the command happens under load
  and the pool has recovered when the phase ends. Answers the phase's counts: CPU seconds,
  reads, puts, get requests, misses and wrong blocks, RSS.
- ``settle SECONDS``: with no load, counts every acknowledged key that fewer than
  ``replicas`` of its current owners (the tier's ring) hold, asking each member directly
  (no read, so no read repair fills a hole), once a second until none is left or
  ``SECONDS`` pass; answers the first and last counts and the rounds it took. Anti-entropy
  alone must bring every key back to ``replicas`` copies on its owners after a DNS change.
- ``check``: stops, reads every acknowledged key back through this tier and through a
  fresh one, answers lost and wrong counts, and exits.

Every block's bytes derive from its key, so a wrong block is seen by the byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import resource
import sys
import time
from typing import Any

import numpy as np

from kvtier.peer.tier import PeerTier

BLOCK_BYTES = 16 << 10
READERS = 8
BATCH = 16


def key_for(i: int) -> bytes:
    return hashlib.blake2b(b"netns-lane-%d" % i, digest_size=16).digest()


def block_for(key: bytes) -> np.ndarray:
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return np.frombuffer(seed * (BLOCK_BYTES // len(seed)), dtype=np.uint8)


def right(key: bytes, got: object) -> bool:
    return isinstance(got, np.ndarray) and got.tobytes() == block_for(key).tobytes()


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class Load:
    def __init__(self, tier: PeerTier) -> None:
        self.tier = tier
        self.acked: list[int] = []
        self.next_key = 0
        self.rng = random.Random(30)

    async def phase(self, name: str, reads: int, members: set[str]) -> dict[str, Any]:
        counts = {"reads": 0, "puts": 0, "put_errors": 0, "missed": 0, "wrong": 0}
        readers_left = READERS
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        requests0 = self.tier.stats().get("get_requests", 0)
        started = time.monotonic()
        first_key = self.next_key

        def settled() -> bool:
            return set(self.tier.members.members) == members

        async def writer() -> None:
            while readers_left:
                i, self.next_key = self.next_key, self.next_key + 1
                key = key_for(i)
                try:
                    await self.tier.put(key, block_for(key))
                except Exception:  # a put that raised was not acknowledged: not checked
                    counts["put_errors"] += 1
                    await asyncio.sleep(0.05)
                    continue
                self.acked.append(i)
                counts["puts"] += 1

        async def reader() -> None:
            nonlocal readers_left
            done, whole = 0, False
            # A phase ends on a read that found every key: after a partition the pool must
            # come back, not just the phase's count of reads run out on misses.
            while done < reads or not settled() or not whole:
                if not self.acked:
                    await asyncio.sleep(0.01)
                    continue
                picked = self.rng.sample(self.acked, min(BATCH, len(self.acked)))
                keys = [key_for(i) for i in picked]
                blocks = await self.tier.get_many(keys)
                whole = all(b is not None for b in blocks)
                for key, got in zip(keys, blocks, strict=True):
                    if got is None:
                        counts["missed"] += 1
                    elif not right(key, got):
                        counts["wrong"] += 1
                done += 1
                counts["reads"] += 1
            readers_left -= 1

        await asyncio.gather(writer(), *(reader() for _ in range(READERS)))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        return {"phase": name, **counts, "keys": [first_key, self.next_key],
                "cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 3),
                "wall_s": round(time.monotonic() - started, 1),
                "get_requests": self.tier.stats().get("get_requests", 0) - requests0,
                "members": sorted(self.tier.members.members), "rss_mib": round(rss_mib(), 1)}


async def read_all(tier: PeerTier, acked: list[int]) -> tuple[int, int]:
    lost = wrong = 0
    for start in range(0, len(acked), 64):
        keys = [key_for(i) for i in acked[start:start + 64]]
        for key, got in zip(keys, await tier.get_many(keys), strict=True):
            if got is None:
                lost += 1
            elif not right(key, got):
                wrong += 1
    return lost, wrong


async def under_replicated(tier: PeerTier, acked: list[int]
                           ) -> tuple[list[dict[str, Any]], int]:
    """The acknowledged keys fewer than ``replicas`` of their current owners hold (each as
    its index, owners and holders), and how many copies lie on members that are not owners
    of their key (stand-ins kept until the ring has been quiet for ``change_window``), by
    asking every member."""
    members = tier.members.members
    keys = [key_for(i) for i in acked]
    held: dict[str, list[bool]] = {}
    for member in members:
        answers: list[bool] = []
        for start in range(0, len(keys), 256):
            answers += await asyncio.wait_for(
                tier.members.client(member).exists_many(keys[start:start + 256]), 10.0)
        held[member] = answers
    under = []
    strays = 0
    for n, key in enumerate(keys):
        owners = tier.members.ring.owners(key, tier.replicas)
        if sum(held[m][n] for m in owners) < tier.replicas:
            under.append({"key": acked[n], "owners": owners,
                          "holders": [m for m in members if held[m][n]]})
        strays += sum(held[m][n] for m in members if m not in owners)
    return under, strays


async def repair_counters(tier: PeerTier) -> dict[str, dict[str, float]]:
    """Each member's anti-entropy counters (from its ``/metrics``)."""
    found: dict[str, dict[str, float]] = {}
    for member in tier.members.members:
        text = await asyncio.wait_for(tier.members.client(member).metrics(), 10.0)
        found[member] = {
            name.removeprefix("kvtier_peer_repair_").removesuffix("_total"): float(value)
            for name, value in (line.split()[:2] for line in text.splitlines()
                                if line.startswith("kvtier_peer_repair_"))}
    return found


async def settle(tier: PeerTier, acked: list[int], within: float) -> dict[str, Any]:
    started = time.monotonic()
    counts = [await under_replicated(tier, acked)]
    while counts[-1][0] and time.monotonic() - started < within:
        await asyncio.sleep(1.0)
        counts.append(await under_replicated(tier, acked))
    under, strays = counts[-1]
    return {"settle": len(acked), "first": len(counts[0][0]), "under": len(under),
            "strays": strays, "rounds": len(counts),
            "wall_s": round(time.monotonic() - started, 1),
            # What a failure needs to be told apart: which keys, where, and the servers'
            # anti-entropy counters.
            "under_keys": under[:8],
            "repair": await repair_counters(tier) if under else {}}


async def main(name: str, port: int, token_file: str) -> int:
    url = (f"peers+dns://{name}:{port}?token=file:{token_file}&replicas=2&ack=all"
           "&dns_interval=0.5&health_interval=0.5&timeout=2")
    async with PeerTier.from_url(url) as tier:
        await tier.contains_many([key_for(-1)])  # opens the tier: DNS resolved once
        say({"ready": sorted(tier.members.members), "rss_mib": round(rss_mib(), 1)})
        load = Load(tier)
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not line or line[0] == "check":
                break
            if line[0] == "settle":
                say(await settle(tier, load.acked, float(line[1])))
                continue
            _, phase, reads, members = line
            say(await load.phase(phase, int(reads), set(members.split(","))))
        await tier.flush()
        lost, wrong = await read_all(tier, load.acked)
        async with PeerTier.from_url(url) as fresh:
            fresh_lost, fresh_wrong = await read_all(fresh, load.acked)
        say({"check": len(load.acked), "lost": lost, "wrong": wrong,
             "fresh_lost": fresh_lost, "fresh_wrong": fresh_wrong,
             "rss_mib": round(rss_mib(), 1), "stats": {
                 k: v for k, v in tier.stats().items() if isinstance(v, int | float)}})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
