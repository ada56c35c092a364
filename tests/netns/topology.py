"""Network namespaces for the multi-host lane: hosts with their own IP addresses on one
bridge, a real dnsmasq as their DNS server, and `kvtier serve` processes inside them.

Everything lives in namespaces this module creates: the bridge sits in a namespace of its
own with no uplink, so no packet of the lane can leave the machine, and the host's own
interfaces, routes and resolver are never touched. ``ip netns exec`` bind-mounts
``/etc/netns/NS/resolv.conf`` over ``/etc/resolv.conf`` for the processes it starts, which
is how every namespace gets dnsmasq as its resolver. :meth:`Topology.close` (also run by
the context manager when the lane fails) stops every process, deletes every namespace and
removes those ``/etc/netns`` entries.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

SUBNET = "10.213.0"  # a /24 that exists only inside the lane's namespaces
DNS_HOST = "dns"
DNS_ADDRESS = f"{SUBNET}.53"
NETNS_ETC = Path("/etc/netns")
READY_NAME = "dns.kvt.test"  # resolves to dnsmasq itself once it answers


def netns_unavailable() -> str | None:
    """Why the lane cannot run here (not root, no ``ip netns``, no dnsmasq), or ``None``."""
    if os.geteuid() != 0:
        return "the netns lane needs root (ip netns, veth pairs, a bridge)"
    for tool in ("ip", "tc", "dnsmasq"):
        if shutil.which(tool) is None:
            return f"the netns lane needs {tool} (apt-get install -y iproute2 dnsmasq-base)"
    probe = f"kvtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


class Topology:
    """Hosts on one bridge, each in its own namespace with address ``SUBNET.<octet>``.

    Parameters
    ----------
    hosts
        ``{host name: last octet}``; a namespace ``kvtNNNN-<name>`` each (``NNNN``: this
        process, so two lanes never collide). A ``dns`` host at ``.53`` is always added.
    workdir
        Where dnsmasq's hosts file and the processes' logs go.
    """

    def __init__(self, hosts: dict[str, int], workdir: Path) -> None:
        self.tag = f"kvt{os.getpid() % 10000}"
        self.hosts = {**hosts, DNS_HOST: 53}
        self.workdir = workdir
        self.hosts_file = workdir / "dns-hosts"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dnsmasq: subprocess.Popen[bytes] | None = None
        self._names: dict[str, list[str]] = {}  # what dnsmasq answers: name -> hosts

    def ns(self, host: str) -> str:
        """The namespace of ``host``."""
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host``."""
        return f"{SUBNET}.{self.hosts[host]}"

    # ---------------------------------------------------------------- set up
    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        bridge = self.ns("br")
        _ip("netns", "add", bridge)
        self._made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for host, octet in self.hosts.items():
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            # Interface names are at most 15 characters: the tag and the octet.
            inner, outer = f"{self.tag}i{octet}", f"{self.tag}o{octet}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", bridge)
            _ip("-n", bridge, "link", "set", outer, "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(f"nameserver {DNS_ADDRESS}\noptions timeout:1\n")
        self.set_dns(READY_NAME, [DNS_HOST])
        log = open(self.workdir / "dnsmasq.log", "wb")  # noqa: SIM115 (kept by the process)
        self._dnsmasq = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(DNS_HOST), "dnsmasq", "--keep-in-foreground",
             "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--bind-interfaces",
             f"--listen-address={DNS_ADDRESS}", f"--addn-hosts={self.hosts_file}",
             "--pid-file=", "--user=root", "--local-ttl=0", "--log-facility=-",
             "--log-queries"],
            stdout=log, stderr=subprocess.STDOUT)
        self._procs.append(self._dnsmasq)
        self._wait_dns()

    def _wait_dns(self, within: float = 30.0) -> None:
        """Wait until dnsmasq answers (a SIGHUP before it set its handler would kill it)."""
        deadline = time.monotonic() + within
        while True:
            asked = subprocess.run(["ip", "netns", "exec", self.ns(DNS_HOST), "getent",
                                    "ahostsv4", READY_NAME], capture_output=True, text=True)
            if asked.returncode == 0:
                return
            assert self._dnsmasq is not None
            if self._dnsmasq.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "dnsmasq.log").read_text(errors="replace")
                raise RuntimeError(f"dnsmasq does not answer:\n{log}")
            time.sleep(0.1)

    # ------------------------------------------------------------------- DNS
    def set_dns(self, name: str, hosts: Sequence[str]) -> None:
        """Make ``name`` resolve to the addresses of ``hosts`` (dnsmasq re-reads its hosts
        file on SIGHUP; TTL 0, so every resolution sees the new set)."""
        self._names[name] = list(hosts)
        lines = "".join(f"{self.address(h)} {n}\n" for n, hs in self._names.items() for h in hs)
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text(lines)
        tmp.replace(self.hosts_file)
        if self._dnsmasq is not None and self._dnsmasq.poll() is None:
            self._dnsmasq.send_signal(signal.SIGHUP)

    def cut(self, host: str, seconds: float) -> None:
        """Partition ``host`` from everyone for ``seconds`` (its link down, then up)."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "down")
        try:
            time.sleep(seconds)
        finally:
            _ip("-n", self.ns(host), "link", "set", "eth0", "up")

    def throttle(self, host: str, rate: str, burst: str, latency: str) -> None:
        """Rate-limit ``host``'s link both ways with a token bucket (``tc tbf``: ``rate``
        such as ``32mbit``, ``burst`` such as ``64kb``, packets queued past ``latency``
        dropped); ``tc netem`` is not available on every kernel, ``tbf`` is."""
        octet = self.hosts[host]
        for ns, dev in ((self.ns(host), "eth0"), (self.ns("br"), f"{self.tag}o{octet}")):
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", burst, "latency", latency)

    def unthrottle(self, host: str) -> None:
        """Remove what :meth:`throttle` put on ``host``'s link."""
        octet = self.hosts[host]
        for ns, dev in ((self.ns(host), "eth0"), (self.ns("br"), f"{self.tag}o{octet}")):
            _tc("-n", ns, "qdisc", "del", "dev", dev, "root")

    # ------------------------------------------------------------- processes
    def popen(self, host: str, argv: Sequence[str], *, log: Path | None = None,
              **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace (stopped by :meth:`close`)."""
        out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.ns(host), *argv],
            stdout=kwargs.pop("stdout", out), stderr=kwargs.pop("stderr", subprocess.STDOUT),
            **kwargs)
        self._procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], wait: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``wait`` seconds."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def close(self) -> None:
        """Stop every process started here, delete every namespace and its resolver file."""
        for proc in reversed(self._procs):
            with contextlib.suppress(OSError):
                self.stop(proc, 5.0)
        self._procs.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()
        # A namespace whose last process is gone is freed at once; give the kernel a moment
        # so a lane run right after this one finds the names free.
        time.sleep(0.1)
