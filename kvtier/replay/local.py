"""The local pool of the dry replay (``--mode local``): blocks stay where they were computed.

Every node keeps the blocks its requests computed in its own memory (C blocks, least recently
used first out). A holder directory (in a real pool: each key's entry on its ring owner)
knows which nodes hold each block, so a request routed to node X reads each prefix block
from X when X holds it, else from any holder (a remote read). A block is a prefix hit when
any node holds it.

On eviction, a block with another copy is dropped. Its **last copy** is forwarded by global
age, as the Global Memory Service does (Feeley et al., SOSP 1995; N-chance forwarding:
Dahlin et al., OSDI 1994): to the node with free room or, else, the node whose oldest block
is the oldest anywhere, when that block is older than the one forwarded (that node then
drops its oldest block, the oldest anywhere); a block that is itself the oldest anywhere is
dropped. Age is the logical time of a block's last use, on any node: a forwarded block keeps
its age. A block read remotely ``hot_reads`` times is hot: if more than one node read it
(a shared prefix, such as a system prompt) and it has fewer than ``max_copies`` copies, the
reader gets a copy; else it moves to the reader (the copy read from is dropped: a session
whose requests now run elsewhere takes its blocks along, and memory is not spent on
duplicates of blocks only one node reads).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

__all__ = ["FORWARD_MARGIN", "HOT_READS", "MAX_COPIES", "LocalPool"]

# Defaults: the configuration docs/pooling-results.md measures ("The local pool against a
# live router"): a block read remotely twice is hot (copied when several nodes read it, up to
# 4 copies, else moved to its reader), and a last copy is forwarded only to a node whose
# oldest block is 1.5x as old.
HOT_READS = 2
MAX_COPIES = 4
FORWARD_MARGIN = 0.5


class LocalPool:
    """Blocks on the node that computed them, a directory of holders, forwarding by age.

    Parameters
    ----------
    nodes
        Serving nodes.
    capacity
        Blocks per node.
    hot_reads
        Remote reads of a block after which a reader keeps a copy (0: never copy).
    max_copies
        Most nodes that may hold one block through hot copies (>= 1); a hot block with that
        many copies moves to its reader.
    forward_margin
        A last copy of age ``a`` (logical time since its last use) is forwarded only to a
        node whose oldest block is older than ``(1 + forward_margin) * a``: 0 is the Global
        Memory Service's rule; more skips swaps of blocks of about the same age, which move
        bytes for no hit.
    """

    def __init__(self, nodes: int, capacity: int, *, hot_reads: int = HOT_READS,
                 max_copies: int = MAX_COPIES, forward_margin: float = FORWARD_MARGIN) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"capacity: expected an int >= 1, got {capacity!r}")
        if type(hot_reads) is not int or hot_reads < 0:
            raise ValueError(f"hot_reads: expected an int >= 0, got {hot_reads!r}")
        if type(max_copies) is not int or max_copies < 1:
            raise ValueError(f"max_copies: expected an int >= 1, got {max_copies!r}")
        self.nodes, self.capacity = nodes, capacity
        if not forward_margin >= 0:
            raise ValueError(f"forward_margin: expected >= 0, got {forward_margin!r}")
        self.hot_reads, self.max_copies = hot_reads, max_copies
        self.forward_margin = float(forward_margin)
        # Per node: key -> logical time of last use, and a lazy min-heap of (time, key)
        # whose stale entries (a later use) are skipped when the oldest is looked for.
        self.held: list[dict[bytes, int]] = [{} for _ in range(nodes)]
        self._heaps: list[list[tuple[int, bytes]]] = [[] for _ in range(nodes)]
        self.holders: dict[bytes, list[int]] = {}  # the directory
        self._remote_reads_of: dict[bytes, int] = {}
        self._readers_of: dict[bytes, set[int]] = {}  # remote readers since it was last hot
        self._tick = 0
        self.local_hits = 0
        self.remote_reads = 0
        self.forwarded = 0  # last copies moved to an older node
        self.dropped_last = 0  # last copies dropped as the oldest anywhere
        self.dropped_copies = 0  # evicted blocks that had another copy
        self.hot_copies = 0
        self.hot_moves = 0
        self.directory_updates = 0  # holder added or removed

    # -- ages ------------------------------------------------------------------------
    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def _set(self, node: int, key: bytes, tick: int) -> None:
        self.held[node][key] = tick
        heap = self._heaps[node]
        heapq.heappush(heap, (tick, key))
        if len(heap) > 4 * self.capacity + 64:  # too many stale entries: rebuild
            heap[:] = [(t, k) for k, t in self.held[node].items()]
            heapq.heapify(heap)

    def _oldest(self, node: int) -> tuple[int, bytes] | None:
        heap, held = self._heaps[node], self.held[node]
        while heap:
            tick, key = heap[0]
            if held.get(key) == tick:
                return tick, key
            heapq.heappop(heap)
        return None

    # -- storage ---------------------------------------------------------------------
    def _store(self, node: int, key: bytes, tick: int) -> None:
        """Put ``key`` (age ``tick``) on ``node``, evicting its oldest block when full."""
        held = self.held[node]
        victim = None
        if len(held) >= self.capacity:
            victim = self._oldest(node)
            assert victim is not None  # a full node has an oldest block
            del held[victim[1]]
            self._unlist(victim[1], node)
        self._set(node, key, tick)
        self.holders.setdefault(key, []).append(node)
        self.directory_updates += 1
        if victim is not None:
            self._evicted(node, *victim)

    def _unlist(self, key: bytes, node: int) -> None:
        where = self.holders[key]
        where.remove(node)
        self.directory_updates += 1
        if not where:
            del self.holders[key]

    def _evicted(self, node: int, tick: int, key: bytes) -> None:
        if key in self.holders:
            self.dropped_copies += 1
            return
        # The last copy: forward it to the node with room, else the one whose oldest block
        # is older than it (the globally oldest; that node then drops its oldest, itself the
        # oldest anywhere, so forwarding never cascades).
        now = self._tick
        # Older than this tick: at least (1 + margin) times the victim's age.
        oldest = now - (1.0 + self.forward_margin) * (now - tick)
        target = -1
        for other in range(self.nodes):
            if other == node:
                continue
            if len(self.held[other]) < self.capacity:
                target = other
                break
            found = self._oldest(other)
            if found is not None and found[0] < oldest:
                target, oldest = other, float(found[0])
        self._remote_reads_of.pop(key, None)
        self._readers_of.pop(key, None)
        if target < 0:
            self.dropped_last += 1
            return
        self.forwarded += 1
        self._store(target, key, tick)

    # -- requests --------------------------------------------------------------------
    def local_run(self, node: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` ``node`` holds itself (no refresh)."""
        held = self.held[node]
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def serve(self, node: int, keys: Sequence[bytes]) -> tuple[int, int]:
        """Serve one request on ``node``: ``(prefix hit blocks, of which read remotely)``.

        The prefix is the run of leading keys some node holds; then every key is refreshed
        or stored, last first (the chain's head ends up most recent): on ``node`` when it
        holds the key or computed it (a miss), else on the holder it was read from.
        """
        holders = self.holders
        hit = 0
        for key in keys:
            if key not in holders:
                break
            hit += 1
        held = self.held[node]
        remote = 0
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            tick = self._now()
            if key in held:
                self._set(node, key, tick)
                if i < hit:
                    self.local_hits += 1
                continue
            where = holders.get(key)
            if where is None:  # computed here: stored here
                self._store(node, key, tick)
                continue
            if i < hit:
                remote += 1
                reads = self._remote_reads_of.get(key, 0) + 1
                self._remote_reads_of[key] = reads
                readers = self._readers_of.setdefault(key, set())
                readers.add(node)
                if self.hot_reads and reads >= self.hot_reads:
                    self._remote_reads_of[key] = 0
                    del self._readers_of[key]
                    if len(readers) > 1 and len(where) < self.max_copies:
                        self.hot_copies += 1
                    else:  # moves: the copy it was read from goes
                        self.hot_moves += 1
                        source = where[0]
                        del self.held[source][key]
                        self._unlist(key, source)
                    self._store(node, key, tick)
                    continue
            # Read from (or, past the hit, recomputed but already held by) another node:
            # that copy is the one used, so its age is refreshed there.
            self._set(where[0], key, tick)
        self.remote_reads += remote
        return hit, remote

    def stats(self) -> dict[str, Any]:
        """Counters for the result row."""
        return {"local_hits": self.local_hits, "remote_reads": self.remote_reads,
                "forwarded": self.forwarded, "dropped_last_copies": self.dropped_last,
                "dropped_copies": self.dropped_copies, "hot_copies": self.hot_copies,
                "hot_moves": self.hot_moves,
                "directory_updates": self.directory_updates,
                "held_blocks": [len(h) for h in self.held]}
