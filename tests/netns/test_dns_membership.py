"""The multi-host lane: five `kvtier serve` hosts with distinct IP addresses in network
namespaces, ``peers+dns://`` through a real dnsmasq, replicas 2, 8 readers and a writer.

The client is first cut off from every member for 3 s (all leave its path at once), then
its link is rate-limited (``tc tbf``, 32 Mbit/s both ways) for a phase; then DNS swaps one
member for a new one, the swapped-out member stops, and a second member leaves DNS and
stops, all under load (the issue-30 row: the client ran at 100% CPU for over
6 minutes and its RSS rose to 8.5 GB). Every phase must finish, and the lane asserts 0
acknowledged keys lost, 0 wrong bytes, and the client's CPU time per operation, get
requests per read and RSS bounded by counts, never by durations. After each member stops
(no load), it asserts that anti-entropy alone brings every acknowledged key back to
``replicas`` copies on its current owners (``settle``: asking each member, reading
nothing, so no read repair helps).

Runs only with ``KVTIER_NETNS_LANE=1``, as root (``.ci/run`` runs it where ``ip netns``
works): ``sudo KVTIER_NETNS_LANE=1 python -m pytest -q -s tests/netns``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_NETNS_LANE") != "1":
    pytest.skip("the netns lane runs with KVTIER_NETNS_LANE=1 (as root)",
                allow_module_level=True)

from tests.helpers.peer_helpers import REPO, TOKEN
from tests.netns.topology import Topology, netns_unavailable

pytestmark = pytest.mark.timeout(900)

NAME = "pool.kvt.test"
PORT = 7070
SERVERS = {f"h{n}": 10 + n for n in range(1, 7)}  # h6 joins when DNS swaps h4 out
READS = 40  # batches per reader per phase
PHASE_TIMEOUT = 240.0  # seconds: a phase that has not answered by then hangs (the bug)
# Per operation (a put, or a get of 16 keys) the client spends a few milliseconds of CPU
# on a loaded box; the bug spent minutes. The bound is loose on purpose: it is a count.
CPU_PER_OP = 0.1
SLOW_RATE = "32mbit"  # the rate-limited link: about 4 MB/s, each reader's batch 256 KiB
# Anti-entropy (repair interval 1 s) must put every acknowledged key back on its owners
# after each DNS change within this many seconds of quiet: it takes a few passes, not
# tens (the bound is loose on purpose; the assertion is the count).
SETTLE_S = 60
RSS_GROWTH_MIB = 300  # the client's RSS over the run, past its size after the first phase


class Client:
    """The lane's client process (tests/netns/dns_client.py) and its JSON answers."""

    def __init__(self, topo: Topology, token_file: Path) -> None:
        self.log = topo.workdir / "client.log"
        self.proc = topo.popen(
            "client", [sys.executable, str(REPO / "tests/netns/dns_client.py"), NAME,
                       str(PORT), str(token_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(self.log, "wb"),  # noqa: SIM115
            env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.decode())

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = PHASE_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return dict(json.loads(self.lines.get(timeout=1.0)))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise AssertionError(f"the client exited ({self.proc.returncode}): "
                                         f"{self.log.read_text(errors='replace')[-3000:]}"
                                         ) from None
        raise AssertionError(f"the client did not answer within {timeout:.0f} s")


def _members(topo: Topology, hosts: list[str]) -> str:
    return ",".join(sorted(f"{topo.address(h)}:{PORT}" for h in hosts))


def _serve(topo: Topology, host: str, token_file: Path) -> subprocess.Popen[bytes]:
    pool = (f"peers+dns://{NAME}:{PORT}?replicas=2&token=file:{token_file}"
            "&dns_interval=0.5&health_interval=0.5&timeout=2")
    return topo.popen(
        host, [sys.executable, "-m", "kvtier.cli", "serve", "--listen",
               f"{topo.address(host)}:{PORT}", "--tier", "dram://?capacity=256MiB",
               "--token-file", str(token_file), "--pool", pool, "--repair-interval", "1"],
        log=topo.workdir / f"{host}.log", cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait_listening(topo: Topology, hosts: list[str], within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    for host in hosts:
        log = topo.workdir / f"{host}.log"
        while "listening on" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"{host} did not start:\n{log.read_text()}"
            time.sleep(0.2)


def test_dns_swap_and_two_leaves_under_load(tmp_path: Path) -> None:
    reason = netns_unavailable()
    assert reason is None, reason  # the lane was asked for: not being able to run fails
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with Topology({**SERVERS, "client": 2}, tmp_path) as topo:
        first = ["h1", "h2", "h3", "h4", "h5"]
        topo.set_dns(NAME, first)
        servers = {h: _serve(topo, h, token_file) for h in SERVERS}
        _wait_listening(topo, list(SERVERS))
        client = Client(topo, token_file)
        ready = client.answer(180.0)
        assert ready["ready"] == _members(topo, first).split(","), ready

        def phase(name: str, hosts: list[str]) -> None:
            client.send(f"phase {name} {READS} {_members(topo, hosts)}")

        swapped = ["h1", "h2", "h3", "h5", "h6"]
        left = ["h1", "h3", "h5", "h6"]
        phase("steady", first)
        answers = [client.answer()]
        # The client cut off from every member: all of them leave its path at once, and
        # readers retrying their misses must not starve the health loop that brings them
        # back (they did: the phase never ended, at 100% CPU).
        phase("partition", first)
        topo.cut("client", 3.0)
        answers.append(client.answer())
        # The client's link rate-limited both ways (a token bucket, tc tbf): its 8
        # readers' answers queue behind each other and packets past the queue drop.
        topo.throttle("client", SLOW_RATE, "64kb", "100ms")
        try:
            phase("slow-link", first)
            answers.append(client.answer())
        finally:
            topo.unthrottle("client")
        phase("swap", swapped)
        topo.set_dns(NAME, swapped)  # h4 out, h6 in
        answers.append(client.answer())
        phase("h4-stopped", swapped)
        servers["h4"].kill()
        answers.append(client.answer())
        client.send(f"settle {SETTLE_S}")
        settles = [client.answer()]
        phase("h2-left", left)
        topo.set_dns(NAME, left)
        answers.append(client.answer())
        phase("h2-stopped", left)
        servers["h2"].kill()
        answers.append(client.answer())
        client.send(f"settle {SETTLE_S}")
        settles.append(client.answer())
        client.send("check")
        check = client.answer()
        for answer in answers + settles:
            print(json.dumps(answer))
        print(json.dumps(check))

        for answer in answers:
            ops = answer["reads"] + answer["puts"]
            assert answer["wrong"] == 0, answer
            assert answer["cpu_s"] <= CPU_PER_OP * ops, answer
            # Each batch read asks each member at most once per round, and walks at most
            # the ring: never more requests than members per batch.
            assert answer["get_requests"] <= answer["reads"] * len(SERVERS), answer
        assert answers[-1]["members"] == _members(topo, left).split(",")
        assert answers[-1]["rss_mib"] - answers[0]["rss_mib"] <= RSS_GROWTH_MIB, answers
        # Anti-entropy alone (the settle reads nothing) put every acknowledged key back on
        # replicas of its owners after the swap and after the leave (it did not: 55 and
        # 20 keys stayed on one owner for the whole minute, and a run lost 4 acked keys).
        for settle in settles:
            assert settle["under"] == 0, settle
        assert check["check"] > 0
        assert (check["lost"], check["wrong"]) == (0, 0), check
        assert (check["fresh_lost"], check["fresh_wrong"]) == (0, 0), check
