"""A real ``mooncake_master`` on loopback and Mooncake store clients in other processes, for
the tests. Run as a script it is such a client: ``python mooncake_servers.py URL`` serves
commands on stdin (``put KEY SEED NBYTES``, ``get KEY`` -> sha256 or ``miss``), holding the
pool's memory segment until stdin closes. Processes are stopped by PID, never by name."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def missing() -> str | None:
    """Why Mooncake tests cannot run here, naming the missing piece (``None``: they can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake Store client unavailable ({exc}): pip install "
                f"mooncake-transfer-engine-non-cuda; apt-get install -y libibverbs1 "
                f"librdmacm1 libnuma1")
    if master_binary() is None:
        return "mooncake_master not found next to the Python interpreter or on PATH"
    return None


def master_binary() -> str | None:
    local = Path(sys.executable).parent / "mooncake_master"
    return str(local) if local.exists() else shutil.which("mooncake_master")


def mooncake_env() -> dict[str, str]:
    # Without it the transfer engine advertises (and dials) a non-loopback address.
    return {**os.environ, "MC_TCP_BIND_ADDRESS": HOST, "GLOG_minloglevel": "2"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master not listening on {port}") from None
            time.sleep(0.1)


class MooncakeMaster:
    """``mooncake_master`` with its RPC port on loopback (P2P handshake, no metadata server)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "master.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.port}", f"--rpc_address={HOST}",
             f"--metrics_host={HOST}", f"--metrics_port={_free_port()}",
             "--default_kv_lease_ttl=100"],
            stdout=log, stderr=subprocess.STDOUT, env=mooncake_env(), cwd=self.workdir)
        log.close()
        _wait_port(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class StoreProcess:
    """Another process with a ``mooncake://`` tier (it mounts the pool's segment)."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**mooncake_env(), "PYTHONPATH": os.pathsep.join(sys.path)})
        if self._line() != "ready":
            raise RuntimeError("mooncake store process did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode().strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self._line()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def _serve(url: str) -> None:
    from kvtier.testing.conformance import sample_block
    from kvtier.tiers.registry import tier_from_url

    async with tier_from_url(url) as tier:
        await tier.contains(b"warm-up-key")
        print("ready", flush=True)
        for line in sys.stdin:
            op, *args = line.split()
            if op == "put":
                await tier.put(bytes.fromhex(args[0]),
                               sample_block(int(args[1]), nbytes=int(args[2])))
                print("ok", flush=True)
            elif op == "get":
                block = await tier.get(bytes.fromhex(args[0]))
                print("miss" if block is None else
                      f"{block.dtype.str}:{block.shape}:{hashlib.sha256(block).hexdigest()}",
                      flush=True)


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1]))
