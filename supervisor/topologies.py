"""Real Redis topologies on free ports, for the tests and `sluice bench chaos --redis-cluster`:
a Redis Cluster (three primaries, three replicas: `redis-server --cluster-enabled` and
`redis-cli --cluster create`) and a primary with a replica watched by Sentinel
(`redis-sentinel`, Debian's package)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from sluice.supervisor.processes import EmbeddedRedis, free_port


def _cli(*args: str, timeout: float = 60.0) -> str:
    out = subprocess.run(["redis-cli", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)}: {out.stdout}{out.stderr}")
    return out.stdout


CLUSTER_PORT_BOUND = 55536  # a node's bus listens on its port + 10000: its port is 55535 or less


class LocalCluster:
    """`primaries` primaries with `replicas` replicas each, every node with AOF on (everysec)."""

    def __init__(self, root: Path, primaries: int = 3, replicas: int = 1) -> None:
        self.root = root
        options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", "2000", "--cluster-allow-reads-when-down", "no",
                   "--repl-diskless-sync-delay", "0")
        self.nodes = [EmbeddedRedis(root / f"node{i}", extra=options, below=CLUSTER_PORT_BOUND)
                      for i in range(primaries * (1 + replicas))]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        if not shutil.which("redis-cli"):
            raise RuntimeError("redis-cli not found")
        for node in self.nodes:
            node.start()
        _cli("--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in _cli("-p", str(n.port), "cluster", "info") for n in self.nodes) and \
                    sum("master_link_status:up" in _cli("-p", str(n.port), "info", "replication")
                        for n in self.nodes) == len(self.nodes) // (1 + self.replicas) * self.replicas:
                return self
            time.sleep(0.2)
        raise RuntimeError("the cluster did not become ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True)

    def primary_of(self, key: str) -> EmbeddedRedis:
        """The node serving `key`'s slot now."""
        with self.client() as c:
            node = c.get_node_from_key(key)
        return next(n for n in self.nodes if n.port == int(node.port))

    def wait_failover(self, dead: EmbeddedRedis, key: str, timeout_s: float = 30.0) -> EmbeddedRedis:
        """The replica that took over `key`'s slot after `dead` stopped."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node is dead or node.process is None or node.process.poll() is not None:
                    continue
                try:
                    info = _cli("-p", str(node.port), "info", "replication", timeout=2)
                    state = _cli("-p", str(node.port), "cluster", "info", timeout=2)
                except (RuntimeError, subprocess.TimeoutExpired):
                    continue
                if "role:master" in info and "cluster_state:ok" in state:
                    slot = int(_cli("-p", str(node.port), "cluster", "keyslot", key).strip())
                    with redis.Redis(port=node.port, decode_responses=True) as c:
                        for start, end, *holders in c.execute_command("CLUSTER", "SLOTS"):
                            if start <= slot <= end and int(holders[0][1]) == node.port:
                                return node
            time.sleep(0.2)
        raise RuntimeError(f"no replica took over {key!r} in {timeout_s}s")


class LocalSentinel:
    """One primary, one replica, and three sentinels (quorum 2) watching them as `service`."""

    def __init__(self, root: Path, service: str = "sluice") -> None:
        self.root = root
        self.service = service
        self.primary = EmbeddedRedis(root / "primary", extra=("--repl-diskless-sync-delay", "0"))
        self.replica: EmbeddedRedis | None = None
        self.sentinels: list[subprocess.Popen] = []
        self.sentinel_ports: list[int] = []

    @property
    def url(self) -> str:
        sentinels = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{sentinels}/{self.service}/0"

    def start(self) -> LocalSentinel:
        binary = shutil.which("redis-sentinel")
        if not binary:
            raise RuntimeError("redis-sentinel not found (apt install redis-sentinel)")
        self.primary.start()
        self.replica = EmbeddedRedis(self.root / "replica",
                                     extra=("--replicaof", "127.0.0.1", str(self.primary.port))).start()
        deadline = time.monotonic() + 30
        while "master_link_status:up" not in _cli("-p", str(self.replica.port), "info", "replication"):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync")
            time.sleep(0.1)
        for i in range(3):
            port = free_port()
            conf = self.root / f"sentinel{i}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2\n"
                            f"sentinel down-after-milliseconds {self.service} 1000\n"
                            f"sentinel failover-timeout {self.service} 5000\n")
            self.sentinels.append(subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.STDOUT))
            self.sentinel_ports.append(port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if all(_cli("-p", str(p), "sentinel", "replicas", self.service, timeout=2).count("127.0.0.1")
                       for p in self.sentinel_ports):
                    return self
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.2)
        raise RuntimeError("sentinels did not see the replica")

    def stop(self) -> None:
        for s in self.sentinels:
            s.kill()
            s.wait()
        for node in (self.primary, self.replica):
            if node is not None:
                node.stop()
