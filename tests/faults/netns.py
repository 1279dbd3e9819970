"""Hosts on a private network, made of Linux network namespaces (root only).

A "hub" namespace holds a bridge with the hub's address (Redis and the api listen there);
every other host is a namespace of its own with one veth into the bridge, and the test's
own (root) namespace gets one too, so the test reaches Redis and the api directly. Taking a
host's bridge port down cuts its cable: its packets are dropped silently (no reset, no
error), as in a real partition, and its open TCP connections resume when the port comes
back up.

Everything is named after this process's pid (namespaces `sluice-<host>-<pid>`, the root
veth `slc<pid>`) and removed by `close()`; namespaces left behind by a run that was killed
(their pid is gone) are removed by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

PREFIX = "sluice-"
HUB = "hub"
_LOCK = Path("/tmp/sluice-netns.lock")  # subnets are chosen one run at a time


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no permission)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Namespaces a killed run left behind (their pid is gone), with what runs in them."""
    listed = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}[\w]+-(\d+))\b", listed, re.M):
        ns, pid = name[0], int(name[1])
        if pid != os.getpid() and not _alive(pid):
            _kill_all_in(ns)
            _ip("netns", "del", ns, check=False)
    # A namespace lives on while another mount namespace holds a copy of its /run/netns mount
    # (a container started meanwhile): its veth into the root namespace is removed by name.
    for link, pid in re.findall(r"^\d+: (slc(\d+))[@:]", _ip("-o", "link", "show", check=False).stdout, re.M):
        if int(pid) != os.getpid() and not _alive(int(pid)):
            _ip("link", "del", link, check=False)


def _kill_all_in(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


class Network:
    """`hosts`: the namespaces besides the hub (each with one link to it)."""

    def __init__(self, hosts: list[str]) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        self.pid = os.getpid()
        self.hosts = list(hosts)
        self.ns = {h: f"{PREFIX}{h}-{self.pid}" for h in [HUB, *hosts]}
        self.root_veth = f"slc{self.pid}"[:15]
        self.subnet: ipaddress.IPv4Network | None = None
        self.addr: dict[str, str] = {}

    # -- building and tearing down ----------------------------------------------------------

    def open(self) -> Network:
        remove_stale()
        try:
            _ip("netns", "add", self.ns[HUB])
        except RuntimeError as err:
            raise NetnsUnavailable(str(err)) from None
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        hub = self.ns[HUB]
        for host in self.hosts:
            _ip("netns", "add", self.ns[host])
        for ns in self.ns.values():
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for host in self.hosts:  # eth0 in the host, a bridge port named after it in the hub
            _ip("link", "add", "eth0", "netns", self.ns[host], "type", "veth", "peer", "name", host, "netns", hub)
            _ip("-n", hub, "link", "set", host, "master", "br0", "up")
        with open(_LOCK, "a") as lock:  # only the root namespace's routes can collide
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = self._free_subnet()
            net = list(self.subnet.hosts())
            self.addr = {HUB: str(net[0]), "root": str(net[-1])}
            self.addr.update((h, str(net[10 + i])) for i, h in enumerate(self.hosts))
            _ip("link", "add", self.root_veth, "type", "veth", "peer", "name", "root", "netns", hub)
            _ip("addr", "add", f"{self.addr['root']}/24", "dev", self.root_veth)
            _ip("link", "set", self.root_veth, "up")
        _ip("-n", hub, "link", "set", "root", "master", "br0", "up")
        _ip("-n", hub, "addr", "add", f"{self.addr[HUB]}/24", "dev", "br0")
        for host in self.hosts:
            _ip("-n", self.ns[host], "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")
            _ip("-n", self.ns[host], "link", "set", "eth0", "up")

    def _free_subnet(self) -> ipaddress.IPv4Network:
        """A /24 of 10.213.0.0/16 that no route of the root namespace touches."""
        routes = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "addr").stdout
        used = [ipaddress.ip_network(m, strict=False) for m in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", routes)]
        for k in range(254):
            third = (self.pid + k) % 254 + 1
            candidate = ipaddress.ip_network(f"10.213.{third}.0/24")
            if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
                return candidate
        raise RuntimeError("no free /24 in 10.213.0.0/16")

    def close(self) -> None:
        """Kill whatever still runs in our namespaces, then remove them and the root veth."""
        for ns in self.ns.values():
            _kill_all_in(ns)
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.root_veth, check=False)  # gone with the hub, unless the hub lingers (see above)

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using it ---------------------------------------------------------------------------

    def exec(self, host: str) -> list[str]:
        """The prefix that runs a command on `host` (the root namespace: none)."""
        return [] if host == "root" else ["ip", "netns", "exec", self.ns[host]]

    def partition(self, host: str) -> None:
        """Pull `host`'s cable at the hub: its traffic is dropped both ways, silently."""
        _ip("-n", self.ns[HUB], "link", "set", host, "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.ns[HUB], "link", "set", host, "up", "master", "br0")

