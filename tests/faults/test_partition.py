"""Workers on hosts of their own: a network partition, not a crash.

Redis and the api run in a "hub" network namespace, each worker in a namespace of its own
with one veth into the hub's bridge (tests/faults/netns.py), the test in the root namespace
with a veth of its own. Pulling a worker host's cable (its bridge port down) leaves the
worker alive and generating, but silent: its requests' leases lapse, the other worker
reclaims and finishes them, and when the cable is back, the stale worker's held-back writes
(token deltas, the commit of a result it finished while cut off) reach Redis and are refused
by the fencing scripts: nothing it writes is visible.

Root only (skipped otherwise): the namespaces, veths and processes are removed in any case.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from sluice.supervisor.processes import stop_processes
from tests.e2e.conftest import settled_log
from tests.faults.conftest import FINALS as FINAL_STATES
from tests.faults.conftest import KEYS, MODEL, MODELS_YAML, audit, record
from tests.faults.netns import HUB, NetnsUnavailable, Network
from tests.faults.test_delivery_modes import finals_agree_with_streams
from tests.faults.test_faults import _heartbeat_since, stream_text, submit, wait_until

pytestmark = [pytest.mark.xdist_group("netns"), pytest.mark.timeout(240)]

LEASE_S = 3.0
TOKEN_DELAY_S = 0.1
MAX_TOKENS = 30  # 3 s of generation per request


class HostCluster:
    """Redis and the api on the hub, workers on hosts of their own; the test talks to both
    from the root namespace over its own veth. Each process logs to logs/<name>.log."""

    def __init__(self, net: Network, tmp: Path, **env: str) -> None:
        self.net = net
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        hub = net.addr[HUB]
        self.redis_url = f"redis://{hub}:6379/0"
        self.url = f"http://{hub}:8000"
        (tmp / "models.yaml").write_text(MODELS_YAML)
        self.env = {**os.environ, "SLUICE_REDIS_URL": self.redis_url, "SLUICE_MODELS_FILE": str(tmp / "models.yaml"),
                    "SLUICE_DATA_DIR": str(tmp / "data"), "SLUICE_LEASE_TIMEOUT_S": str(LEASE_S),
                    "SLUICE_WORKER_TTL_S": "3", "SLUICE_HEARTBEAT_INTERVAL_S": "0.3", "SLUICE_CANCEL_POLL_S": "0.1",
                    "SLUICE_SHUTDOWN_TIMEOUT_S": "2", "SLUICE_NULL_TOKEN_DELAY_S": str(TOKEN_DELAY_S),
                    "SLUICE_REPLY_TTL_S": "900",  # the reply streams outlive the checks after the heal
                    "SLUICE_LOG_LEVEL": "INFO", "SLUICE_ALLOW_ANONYMOUS": "1", **env}
        self.redis: subprocess.Popen | None = None
        self.api: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def _spawn(self, host: str, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as out:
            return subprocess.Popen([*self.net.exec(host), *args], env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def start_redis(self) -> None:
        data = self.tmp / "redis"
        data.mkdir(exist_ok=True)
        self.redis = self._spawn(HUB, "redis", [
            "redis-server", "--bind", self.net.addr[HUB], "127.0.0.1", "--port", "6379", "--protected-mode", "no",
            "--dir", str(data), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--maxmemory-policy", "noeviction"])
        r = self.sync()
        wait_until(lambda: self._pings(r), "Redis on the hub", timeout_s=15)

    def _pings(self, r: redis_sync.Redis) -> bool:
        assert self.redis is not None and self.redis.poll() is None, "redis-server exited"
        try:
            return bool(r.ping())
        except redis_sync.RedisError:
            return False

    def start_api(self) -> None:
        self.api = self._spawn(HUB, "api", [sys.executable, "-m", "sluice.cli", "api", "--host", self.net.addr[HUB],
                                            "--port", "8000"])

        def healthy() -> bool:
            assert self.api is not None and self.api.poll() is None, self.tail("api")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, "the api on the hub", timeout_s=60)

    def start_worker(self, name: str) -> None:
        """Worker `name` on the host of the same name."""
        self.workers[name] = self._spawn(name, name, [sys.executable, "-m", "sluice.cli", "worker", "--model", MODEL,
                                                      "--name", name, "--engine", "null"])

    def wait_workers(self, *names: str, timeout_s: float = 60) -> None:
        def live() -> bool:
            for n in names:
                assert self.workers[n].poll() is None, self.tail(n)
            try:
                workers = httpx.get(f"{self.url}/v1/workers", timeout=2).json()["workers"]
            except (httpx.HTTPError, KeyError, ValueError):
                return False
            return set(names) <= {w["name"] for w in workers if w["state"] == "running"}

        wait_until(live, f"workers {names} live", timeout_s=timeout_s)

    def sync(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=10)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tail(self, name: str, lines: int = 40) -> str:
        return f"--- {name}.log ---\n" + "\n".join(self.log(name).splitlines()[-lines:])

    def stop(self) -> None:
        for host in self.net.hosts:  # a test that failed mid-partition: let the workers drain and go
            with contextlib.suppress(RuntimeError):
                self.net.heal(host)
        stop_processes([*self.workers.values(), *([self.api] if self.api else [])], timeout_s=10)
        if self.redis is not None:
            stop_processes([self.redis], timeout_s=5)


@contextlib.contextmanager
def host_cluster(tmp_path: Path, hosts: list[str]) -> Iterator[HostCluster]:
    try:
        net = Network(hosts).open()
    except NetnsUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err}")
    try:
        c = HostCluster(net, tmp_path)
        try:
            c.start_redis()
            c.start_api()
            yield c
        except BaseException:
            print("\n".join(c.tail(n) for n in ["api", *c.workers]))  # shown with the failure
            raise
        finally:
            c.stop()
    finally:
        net.close()


def snapshot(r: redis_sync.Redis, rids: list[str]) -> dict[str, object]:
    """Everything a client can see of these requests: reply streams, statuses, the inference log."""
    return {"replies": {rid: r.xrange(KEYS.reply(rid)) for rid in rids},
            "statuses": {rid: r.hgetall(KEYS.status(rid)) for rid in rids},
            "log": r.xrange(KEYS.log)}


def fenced_in_log(log: str, rid: str) -> bool:
    """Whether the worker wrote in its log that it let go of `rid` (its lease refresh found
    it taken, or its commit was refused)."""
    return bool(re.search(rf"request {re.escape(rid)}\b.*reclaimed by another worker", log))


def cut_mid_generation(c: HostCluster) -> tuple[list[str], dict[str, str], list[threading.Thread], list[str], float]:
    """w1 and w2 running 10 requests (readers following each); w1's cable pulled once one of
    its requests is halfway through. Returns the requests, what the readers streamed (once
    joined), the readers, the requests w1 held at the cut, and when it was cut."""
    c.start_worker("w1")
    c.start_worker("w2")
    c.wait_workers("w1", "w2")
    rids, _ = submit(c, 10, max_tokens=MAX_TOKENS)
    streamed: dict[str, str] = {}
    readers = [threading.Thread(target=stream_text, args=(c.url, rid, streamed), daemon=True) for rid in rids]
    for t in readers:
        t.start()
    r = c.sync()

    def w1_halfway() -> bool:
        return any(r.hget(KEYS.status(rid), "worker") == "w1"
                   and int(r.hget(KEYS.status(rid), "next:0") or 0) >= MAX_TOKENS // 2 for rid in rids)

    wait_until(w1_halfway, "worker w1 halfway through a request")
    c.net.partition("w1")
    cut_at = time.monotonic()
    time.sleep(0.2)  # what w1 sent before the cut has landed; nothing it sends now arrives
    # What w1 held at the cut (nobody reclaims before its lease lapses: this is exact).
    owned = [rid for rid in rids if r.hget(KEYS.status(rid), "worker") == "w1"
             and r.hget(KEYS.status(rid), "state") == "running"]
    assert owned, "w1 held nothing at the cut: the test would prove nothing"
    return rids, streamed, readers, owned, cut_at


def test_a_partitioned_worker_host_is_taken_over_and_fenced_out(tmp_path: Path) -> None:
    with host_cluster(tmp_path, ["w1", "w2"]) as c:
        rids, streamed, readers, owned, cut_at = cut_mid_generation(c)
        r = c.sync()
        delivered_at_cut = {rid: int(r.hget(KEYS.status(rid), "next:0") or 0) for rid in owned}

        # Taken over by w2 while w1 stays cut off: together, as the batch w1 was running (a first
        # redelivery runs beside anything; only a batch that crashes again is split in halves,
        # broker/delivery/quarantine.py).
        taken: dict[str, float] = {}
        done_at = None
        deadline = cut_at + LEASE_S + len(owned) * MAX_TOKENS * TOKEN_DELAY_S + 30
        while done_at is None:
            assert time.monotonic() < deadline, {rid: r.hgetall(KEYS.status(rid)) for rid in owned}
            now = time.monotonic()
            for rid in owned:
                if rid not in taken and r.hget(KEYS.status(rid), "worker") == "w2":
                    taken[rid] = now - cut_at
            if all(r.hget(KEYS.status(rid), "state") in FINAL_STATES for rid in rids):
                done_at = now - cut_at
            time.sleep(0.05)
        assert c.workers["w1"].poll() is None  # partitioned, not dead
        # The first is taken over within about the lease (its last refresh came up to a third
        # of a lease before the cut); the rest are reclaimed with it, as w2's fetches have room.
        assert min(taken.values()) < LEASE_S + 5, taken
        for t in readers:
            t.join(60)
        figures = audit(c, rids)
        assert figures == {"completed": 10, "duplicated": 0, "lost": 0}
        finals_agree_with_streams(c, rids, streamed)
        for rid in owned:
            result = json.loads(r.hget(KEYS.status(rid), "result"))
            assert result["attempt"] == 2 and r.hget(KEYS.status(rid), "worker") == "w2", result
        settled_log(r, KEYS.log, set(rids))  # w2's buffered log records have landed
        before = snapshot(r, rids)

        # The cable is back: w1's held-back writes reach Redis and are refused.
        c.net.heal("w1")
        healed_at = time.monotonic()
        wait_until(lambda: all(fenced_in_log(c.log("w1"), rid) for rid in owned),
                   "w1 letting go of every request it lost", timeout_s=90)
        since = time.time()  # and is a live worker again, running nothing
        wait_until(lambda: _heartbeat_since(r, "w1", since, in_flight=0), "a heartbeat of w1 after the heal", 30)
        let_go = time.monotonic() - healed_at
        # It finished while cut off: its commits, held back on their connection (TCP retransmits
        # after a backoff of seconds, where the lease refresh may take a fresh connection and land
        # first: CI once checked before they arrived), reach Redis and are refused. Only then is
        # the snapshot below after all of w1's held-back writes.
        wait_until(lambda: "result dropped" in c.log("w1"), "w1's held-back commits refused", timeout_s=60)
        after = snapshot(r, rids)
        assert after == before, "w1 wrote something visible after the heal"
        logged = [json.loads(f["data"]) for _, f in after["log"]]
        assert sorted(x["request_id"] for x in logged) == sorted(rids)  # one inference-log record each
        assert all(x["batch_id"].startswith("w2-") for x in logged if x["request_id"] in owned)

        # w1 is a healthy worker again: with w2 gone, it serves new requests.
        c.workers["w2"].send_signal(signal.SIGTERM)
        assert c.workers["w2"].wait(30) == 0
        again, _ = submit(c, 2, max_tokens=5)
        wait_until(lambda: all(r.hget(KEYS.status(rid), "state") == "done" for rid in again), "w1 serving", 30)
        assert {r.hget(KEYS.status(rid), "worker") for rid in again} == {"w1"}

        record("partition a worker host past its lease", 10, len(rids), figures, done_at)
        print(f"\npartition: w1 held {len(owned)} (tokens delivered at the cut: {sorted(delivered_at_cut.values())}); "
              f"taken over by w2 at {sorted(round(s, 2) for s in taken.values())} s; all done {done_at:.2f} s "
              f"after the cut (lease {LEASE_S} s); w1 let go {let_go:.2f} s after the heal")


def test_a_host_back_before_its_requests_are_all_taken_over(tmp_path: Path) -> None:
    """The cable comes back while w2 has taken over only some of w1's requests: each of the
    others is finished by whichever worker owns its entry when its writes land (w1 resuming
    its lease, or w2 reclaiming it first), never by both."""
    with host_cluster(tmp_path, ["w1", "w2"]) as c:
        rids, streamed, readers, owned, cut_at = cut_mid_generation(c)
        r = c.sync()
        wait_until(lambda: any(r.hget(KEYS.status(rid), "worker") == "w2" for rid in owned),
                   "w2 taking over a request of w1", timeout_s=LEASE_S + 30)
        c.net.heal("w1")
        healed = time.monotonic() - cut_at
        taken_before_heal = {rid for rid in owned if r.hget(KEYS.status(rid), "worker") == "w2"}
        wait_until(lambda: all(r.hget(KEYS.status(rid), "state") in FINAL_STATES for rid in rids),
                   "every request final", timeout_s=LEASE_S + len(owned) * MAX_TOKENS * TOKEN_DELAY_S + 60)
        done_at = time.monotonic() - cut_at
        for t in readers:
            t.join(60)
        figures = audit(c, rids)
        assert figures == {"completed": 10, "duplicated": 0, "lost": 0}
        finals_agree_with_streams(c, rids, streamed)
        by = {}
        for rid in owned:
            result = json.loads(r.hget(KEYS.status(rid), "result"))
            by[rid] = (r.hget(KEYS.status(rid), "worker"), result["attempt"])
            assert by[rid] in {("w1", 1), ("w2", 2)}, by[rid]
        assert all(by[rid] == ("w2", 2) for rid in taken_before_heal)
        # Whatever w1 still had to say about the requests w2 finished is refused.
        wait_until(lambda: all(fenced_in_log(c.log("w1"), rid) for rid in owned if by[rid][0] == "w2"),
                   "w1 letting go of the requests it lost", timeout_s=90)
        since = time.time()
        wait_until(lambda: _heartbeat_since(r, "w1", since, in_flight=0), "a heartbeat of w1 after the heal", 30)
        settled_log(r, KEYS.log, set(rids))
        before = snapshot(r, rids)
        time.sleep(1.0)  # nothing is left to land
        assert snapshot(r, rids) == before
        logged = [json.loads(f["data"]) for _, f in before["log"]]
        assert sorted(x["request_id"] for x in logged) == sorted(rids)
        for x in logged:
            if x["request_id"] in owned:
                assert x["batch_id"].startswith(f"{by[x['request_id']][0]}-"), (x, by)
        record("partition healed mid-takeover", 10, len(rids), figures, done_at)
        print(f"\nhealed mid-takeover: w1 held {len(owned)}, healed {healed:.2f} s after the cut; finished by "
              f"w1 (attempt 1): {sum(v == ('w1', 1) for v in by.values())}, by w2 (attempt 2): "
              f"{sum(v == ('w2', 2) for v in by.values())}; all done {done_at:.2f} s after the cut")
