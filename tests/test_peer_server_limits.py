"""PeerServer resources under hostile or careless clients: body budget, bounded batch
answers, timeouts, the connection cap, the open-files limit, the accept-error log, aborted
bodies, abandoned puts, bounded request metrics, and /metrics in the exact text format.
Real in-process servers on loopback; raw sockets where a client must misbehave."""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import sys
import tracemalloc
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.codec import encode_frame
from kvtier.peer import protocol as proto
from kvtier.peer.metrics import render
from kvtier.peer.server import PeerServer
from kvtier.peer.tier import PeerTier
from kvtier.store import open_store
from kvtier.testing.conformance import key_of, sample_block
from kvtier.testing.fakes import LatencyTier
from kvtier.tiers.dram import DRAMTier
from tests.helpers.peer_helpers import TOKEN

AUTH = f"Authorization: Bearer {TOKEN}\r\n"


@pytest.fixture
async def server() -> AsyncIterator[PeerServer]:
    s = PeerServer(DRAMTier(), token=TOKEN, close_segment=True)
    await s.start()
    yield s
    await s.stop()


async def _raw(server: PeerServer, data: bytes) -> tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(data)
    await writer.drain()
    return reader, writer


def _put_head(key: bytes, length: int) -> bytes:
    return (f"PUT /v1/blocks/{key.hex()} HTTP/1.1\r\nHost: x\r\n{AUTH}"
            f"Content-Length: {length}\r\n\r\n").encode()


async def _until(cond: object, seconds: float = 15.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


# ----------------------------------------------------------------- item 12: /metrics
async def test_metrics_are_typed_and_parse_with_prometheus_client() -> None:
    server = PeerServer(await open_store(["dram://?capacity=64MiB"]), token=TOKEN,
                        close_segment=True)
    async with server, PeerTier.from_url(f"peers://{server.member_id}?token={TOKEN}"
                                         "&timeout=5") as t:
        await t.put(key_of(1), sample_block(1))
        assert await t.get(key_of(1)) is not None
        await _check_metrics(server)


async def _check_metrics(server: PeerServer) -> None:
    async with aiohttp.ClientSession() as http, \
            http.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        text = await r.text()
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        assert "X-Prometheus-Format" not in r.headers
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds["kvtier_peer_requests"] == "counter"
    assert kinds["kvtier_store_hits"] == "counter"  # a running total, not a gauge
    assert kinds["kvtier_store_evictions"] == "counter"
    assert kinds["kvtier_store_used"] == "gauge"
    assert kinds["kvtier_peer_uptime_seconds"] == "gauge"
    assert text.count("# TYPE kvtier_store_hits_total counter") == 1


async def test_metrics_without_prometheus_client_are_the_same_text(
        server: PeerServer, monkeypatch: pytest.MonkeyPatch) -> None:
    await server.segment.put(key_of(1), sample_block(1))
    server.requests[('/v1/blocks/{key}', "GET", 200)] += 3
    families = server.metric_families()
    with_client, content_type = render(families)
    assert "version=" in content_type
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    without, fallback_type = render(families)
    assert without == with_client
    assert fallback_type == "text/plain; version=0.0.4; charset=utf-8"
    names = [f.name for f in text_string_to_metric_families(without.decode())]
    assert len(names) == len(set(names)) == len(families)


# ------------------------------------------------------------- item 16: server resources
async def test_a_request_head_that_never_completes_is_cut_off() -> None:
    async with PeerServer(DRAMTier(), token=TOKEN, idle_timeout=0.3) as s:
        reader, writer = await _raw(s, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")  # no end
        assert await asyncio.wait_for(reader.read(), 20) == b""  # closed by the server
        writer.close()


async def test_a_stalled_body_is_refused_with_408_and_releases_its_budget() -> None:
    async with PeerServer(DRAMTier(), token=TOKEN, body_timeout=0.3) as s:
        reader, writer = await _raw(s, _put_head(b"\x01", 4096) + b"x" * 10)
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408")
        assert s.body_timeouts == 1 and s.budget.held == 0
        assert not await s.segment.contains(b"\x01")


async def test_connections_past_the_cap_get_503_and_the_server_stays_usable() -> None:
    async with PeerServer(DRAMTier(), token=TOKEN, max_connections=2) as s:
        idle = [await asyncio.open_connection(s.host, s.port) for _ in range(2)]
        await _until(lambda: s._open_connections() == 2)
        reader, writer = await _raw(s, b"")
        assert (await asyncio.wait_for(reader.read(), 20)).startswith(b"HTTP/1.1 503")
        writer.close()
        assert s.connections_refused == 1
        for _, w in idle:
            w.close()
        await _until(lambda: s._open_connections() == 0)
        async with aiohttp.ClientSession() as http, http.get(
                s.url + "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200


async def test_start_raises_the_open_files_soft_limit_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lower = min(soft, 256)
    if hard == resource.RLIM_INFINITY or hard <= lower:
        pytest.skip("no finite hard limit above 256 to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (lower, hard))
    try:
        async with PeerServer(DRAMTier(), token=TOKEN):
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_accept_errors_are_logged_at_a_bounded_rate(
        server: PeerServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(500):  # what the loop reports for each failed accept() at EMFILE
            logging.getLogger("asyncio").error("socket.accept() out of system resource")
        logging.getLogger("asyncio").error("Task exception was never retrieved")
    texts = [r.getMessage() for r in caplog.records]
    assert sum("accept" in t for t in texts) <= 1
    assert "Task exception was never retrieved" in texts  # other records pass


async def test_aborted_put_bodies_are_freed_without_a_gc_pass(server: PeerServer) -> None:
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        n, declared = 8, 8 << 20
        for i in range(n):
            _, writer = await _raw(server, _put_head(bytes([i + 1]), declared) + bytes(1 << 20))
            await asyncio.sleep(0.05)
            writer.close()
        await _until(lambda: server.client_gone >= n)
        await asyncio.sleep(0.2)
        held = tracemalloc.get_traced_memory()[0] - before
        assert held < 16 << 20, f"{held >> 20} MiB of aborted bodies still held"
    finally:
        tracemalloc.stop()
        gc.enable()


async def test_batch_get_serves_a_repeated_key_once(server: PeerServer) -> None:
    block = sample_block(1, nbytes=64 << 10)
    await server.segment.put(key_of(1), block)
    body = b"".join(bytes(b) for b in [proto.encode_keys([key_of(1)] * 1000)])
    async with aiohttp.ClientSession() as http, http.post(
            server.url + proto.BATCH_GET_PATH, data=body,
            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        answer = await r.read()
    assert len(answer) < 2 * (64 << 10)  # one frame, not a thousand
    entries = proto.decode_blocks(answer, 1000, proto.Limits().max_frame_bytes)
    assert entries[0][1] is not None and all(f is None for _, f in entries[1:])


async def test_put_stored_after_its_client_gave_up_is_counted() -> None:
    async with PeerServer(LatencyTier(DRAMTier(), delay=0.3), token=TOKEN) as s:
        frame = encode_frame(sample_block(1)).to_bytes()
        _, writer = await _raw(s, _put_head(b"\x07", len(frame)) + frame)
        writer.close()  # the client's deadline passed
        await _until(lambda: s.puts_abandoned == 1)
        assert await s.segment.inner.contains(b"\x07")  # type: ignore[attr-defined]


async def test_request_metrics_stay_bounded_whatever_methods_strangers_send(
        server: PeerServer) -> None:
    # Methods the HTTP parser accepts and the app sees (before auth): each would have been
    # its own metrics key.
    methods = ["PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "SEARCH",
               "PURGE", "REPORT", "MKACTIVITY", "CHECKOUT", "MERGE", "NOTIFY", "SUBSCRIBE",
               "UNSUBSCRIBE", "PATCH", "OPTIONS", "TRACE", "LINK", "UNLINK", "MKCALENDAR",
               "BIND", "REBIND", "UNBIND", "ACL"]
    for method in methods:
        reader, writer = await _raw(server, f"{method} /v1/health HTTP/1.1\r\nHost: x\r\n"
                                            "Connection: close\r\n\r\n".encode())
        await asyncio.wait_for(reader.read(), 20)
        writer.close()
    assert sum(server.requests.values()) >= 10  # they reached the app
    assert len(server.requests) <= 2


# --------------------------------------------------- item 8: in-flight budget, batch bound
async def test_declared_bodies_past_the_inflight_budget_get_503() -> None:
    limits = proto.Limits(max_block_bytes=1 << 20, max_body_bytes=2 << 20)
    async with PeerServer(DRAMTier(), token=TOKEN, limits=limits,
                          max_inflight_bytes=2 << 20) as s:
        _, held_w = await _raw(s, _put_head(b"\x01", 1 << 20) + b"x" * 100)
        await _until(lambda: s.budget.held == 1 << 20)
        second_r, second_w = await _raw(s, _put_head(b"\x02", (1 << 20) + 8) + b"x" * 100)
        answer = await asyncio.wait_for(second_r.read(64), 20)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert s.budget.refused == 1 and s.budget.held == 1 << 20
        for w in (held_w, second_w):
            w.close()
        await _until(lambda: s.budget.held == 0)
        async with PeerTier.from_url(f"peers://{s.member_id}?token={TOKEN}&timeout=5") as t:
            await t.put(key_of(9), sample_block(9))  # the server is usable again


async def test_batch_answers_stop_at_the_body_limit_and_the_client_gets_everything() -> None:
    limits = proto.Limits(max_block_bytes=256 << 10, max_body_bytes=1 << 20)
    async with PeerServer(DRAMTier(), token=TOKEN, limits=limits) as s:
        blocks = [sample_block(i, nbytes=200 << 10) for i in range(12)]
        for i, b in enumerate(blocks):
            await s.segment.put(key_of(i), b)
        async with aiohttp.ClientSession() as http, http.post(
                s.url + proto.BATCH_GET_PATH, data=proto.encode_keys(
                    [key_of(i) for i in range(12)]),
                headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            answer = await r.read()
        assert len(answer) <= limits.max_body_bytes
        assert s.batch_truncated >= 1
        async with PeerTier(members=[s.member_id], token=TOKEN, timeout=5,
                            limits=limits) as tier:
            got = await tier.get_many([key_of(i) for i in range(12)])
        assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, blocks,
                                                                           strict=True))


async def test_repair_writes_are_admitted_while_client_writes_get_503() -> None:
    """Client PUTs hold the in-flight budget: the next client PUT gets 503, while a repair
    PUT (``?fill=1``: what read repair, hinted handoff and anti-entropy send) is still
    admitted, into the budget's repair reserve, and stored."""
    limits = proto.Limits(max_block_bytes=1 << 20, max_body_bytes=1 << 20)
    async with PeerServer(DRAMTier(), token=TOKEN, limits=limits, max_inflight_bytes=4 << 20,
                          min_body_rate=0) as s:
        stalled, pending = [], []
        for i in range(40):  # declared 256 KiB bodies that never arrive, until one is refused
            before = s.budget.held
            reader, writer = await _raw(s, _put_head(key_of(100 + i), 256 << 10) + b"x")
            stalled.append(writer)
            answer = asyncio.ensure_future(reader.read(64))
            pending.append(answer)
            await _until(lambda b=before, a=answer: s.budget.held > b or a.done())
            if answer.done():
                assert answer.result().startswith(b"HTTP/1.1 503"), answer.result()
                break
        else:
            raise AssertionError("the in-flight budget never filled")
        frame = encode_frame(sample_block(1, 64 << 10), key=key_of(1)).to_bytes()
        statuses = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            for query in ("", f"?{proto.FILL_QUERY}"):
                async with http.put(f"{s.url}/v1/blocks/{key_of(1).hex()}{query}",
                                    data=frame) as r:
                    statuses.append(r.status)
        for answer in pending:
            answer.cancel()
        for writer in stalled:
            writer.close()
        assert statuses == [503, 204]
        assert await s.segment.contains(key_of(1))
        assert s.budget.reserve_admissions == 1
        await _until(lambda: s.budget.held == 0)
