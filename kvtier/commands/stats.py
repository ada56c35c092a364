"""``kvtier stats``: print a peer's health document and a summary of its metrics."""

from __future__ import annotations

import argparse
import asyncio
import json

__all__ = ["HELP", "NAME", "add_arguments", "run", "summarize_metrics"]

NAME = "stats"
HELP = "show a peer server's /v1/health and a summary of its /metrics"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``kvtier stats`` options."""
    parser.add_argument("url", help="peer base URL, e.g. http://127.0.0.1:7070")
    parser.add_argument("--token-file", metavar="FILE", help="file holding the bearer token")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA certificate to trust (https)")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="client key (mutual TLS)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def summarize_metrics(text: str) -> dict[str, float]:
    """Sum Prometheus samples by metric name, plus request counts by status class."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + number
        if name == "kvtier_peer_requests_total" and 'status="' in name_labels:
            status = name_labels.split('status="', 1)[1][:1] + "xx"
            key = f"requests_{status}"
            out[key] = out.get(key, 0.0) + number
    return out


def run(args: argparse.Namespace) -> int:
    """Fetch and print; returns 0, or 1 when the peer cannot be reached."""
    return asyncio.run(_stats(args))


async def _stats(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from kvtier.errors import KVTierError
    from kvtier.peer.client import PeerClient
    from kvtier.peer.tls import client_context
    from kvtier.redact import mask_secrets
    from kvtier.urls import parse_secret

    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        print(f"kvtier stats: url: expected http(s)://host:port, got {mask_secrets(args.url)!r}")
        return 2
    try:
        token = parse_secret(f"file:{args.token_file}", "--token-file") \
            if args.token_file else None
        ctx = client_context(args.tls_ca, args.tls_cert, args.tls_key) \
            if parts.scheme == "https" else None
    except KVTierError as exc:
        print(f"kvtier stats: {exc}")
        return 2
    client = PeerClient(parts.netloc, token=token, timeout=args.timeout, ssl_context=ctx,
                        pool_limit=1)
    try:
        health = await client.health()
        metrics = summarize_metrics(await client.metrics())
    except KVTierError as exc:
        print(f"kvtier stats: {exc}")
        return 1
    finally:
        await client.close()
    if args.json:
        print(json.dumps({"health": health, "metrics": metrics}, indent=2, sort_keys=True))
        return 0
    print(f"node {health.get('node_id')}  version {health.get('version')}  "
          f"uptime {health.get('uptime_s')} s")
    print(f"used {health.get('used')} / capacity {health.get('capacity')} bytes, "
          f"{health.get('blocks')} blocks")
    for i, tier in enumerate(health.get("tiers") or []):
        print(f"  tier {i}: {tier.get('scheme')} used={tier.get('used')} "
              f"capacity={tier.get('capacity')} blocks={tier.get('blocks')}")
    for name in sorted(metrics):
        value = metrics[name]
        print(f"{name} {int(value) if value.is_integer() else value}")
    return 0
