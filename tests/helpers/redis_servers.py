"""Real redis-server processes on loopback for the tests: one server, or a cluster with one
replica per primary (``redis-cli --cluster create``). Stopped by PID, never by name."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
MISSING = None if REDIS_SERVER and REDIS_CLI else \
    "redis-server/redis-cli not installed (apt-get install -y redis-server)"
HOST = "127.0.0.1"


def _free_port(cluster: bool) -> int:
    # A cluster node also needs its bus port (port + 10000) free.
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port + 10000 >= 65536:
            continue
        if cluster:
            with socket.socket() as bus:
                try:
                    bus.bind((HOST, port + 10000))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port pair for a redis cluster node")


class RedisServer:
    """One ``redis-server`` process: no persistence, ``allkeys-lru``, loopback only."""

    def __init__(self, workdir: Path, *, cluster: bool = False, port: int | None = None,
                 tls: tuple[Path, Path, Path] | None = None) -> None:
        if MISSING:
            raise RuntimeError(MISSING)
        self.workdir = workdir
        self.cluster = cluster
        self.port = port or _free_port(cluster)
        self.tls = tls  # (ca, cert, key): TLS only, on ``port``
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [str(REDIS_SERVER), "--port", str(self.port), "--bind", HOST,
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru",
                "--protected-mode", "no", "--logfile", str(self.workdir / "redis.log")]
        if self.tls is not None:
            ca, cert, key = self.tls
            args[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-ca-cert-file",
                         str(ca), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                         "--tls-auth-clients", "no"]
        if self.cluster:
            conf = self.workdir / "nodes.conf"
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(conf),
                     "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client() as client:
                    if client.ping():
                        return
            except redis.RedisError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited; see {self.workdir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} not ready")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> redis.Redis:
        tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls[0])}
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5, **tls)


class RedisCluster:
    """``primaries`` cluster nodes, each with one replica, created with ``redis-cli``."""

    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", cluster=True)
                      for i in range(primaries * 2)]

    @property
    def url_hosts(self) -> str:
        return ",".join(n.address for n in self.nodes[:3])

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run([str(REDIS_CLI), "--cluster", "create",
                        *(n.address for n in self.nodes), "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and every primary has a replica
        that is connected and in sync."""
        deadline = time.monotonic() + timeout
        while True:
            if self._healthy():
                return
            if time.monotonic() > deadline:
                raise TimeoutError("redis cluster did not become healthy")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            for node in self.nodes:
                if node.proc is None:
                    continue
                with node.client() as c:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
                    info = c.info("replication")
                    if info["role"] == "master" and info.get("connected_slaves", 0) < 1:
                        return False
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
            return True
        except redis.RedisError:
            return False

    def primary_of(self, rkey: bytes) -> RedisServer:
        with self.nodes[0].client() as c:
            slot = c.cluster("keyslot", rkey)
            for node in self.nodes:
                if node.proc is None:
                    continue
                with node.client() as nc:
                    info = nc.info("replication")
                    if info["role"] != "master":
                        continue
                    for lo, hi in _own_slots(nc):
                        if lo <= int(slot) <= hi:
                            return node
        raise LookupError(f"no primary serves {rkey!r}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def _own_slots(client: redis.Redis) -> list[tuple[int, int]]:
    myself = client.execute_command("CLUSTER", "MYID")
    myself = myself.decode() if isinstance(myself, bytes) else myself
    ranges = []
    for entry in client.execute_command("CLUSTER", "SLOTS"):
        lo, hi, primary = entry[0], entry[1], entry[2]
        node_id = primary[2].decode() if isinstance(primary[2], bytes) else primary[2]
        if node_id == myself:
            ranges.append((int(lo), int(hi)))
    return ranges
