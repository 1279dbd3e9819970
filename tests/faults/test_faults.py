"""Kill real processes and check that no accepted request is lost or answered twice."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis as redis_sync

from sluice.bench.sse import events
from sluice.broker.keys import WORKERS
from tests.faults.conftest import KEYS, MODEL, Cluster, audit, crash_until_final, queued, record, wait_final
from tests.faults.kills import kill_mid_generation


def submit(c: Cluster, n: int, *, max_tokens: int = 20, prompt: str = "hello", **extra) -> tuple[list[str], int]:
    """Submit n requests; returns the accepted ids and how many were refused with 503."""
    rids, refused = [], 0
    with httpx.Client(base_url=c.url, timeout=30) as client:
        for i in range(n):
            r = client.post("/v1/requests", json={"prompt": f"{prompt} {i}", "max_tokens": max_tokens, **extra})
            if r.status_code == 503:
                assert r.headers.get("retry-after"), r.headers
                refused += 1
            else:
                assert r.status_code == 202, r.text
                rids.append(r.json()["id"])
    return rids, refused


def wait_until(check: Callable[[], object], what: str, timeout_s: float = 30) -> None:
    """Wait for a condition, with a generous limit (a failure, never a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)


def _heartbeat_since(r: redis_sync.Redis, name: str, since: float, *, in_flight: int) -> bool:
    raw = r.hget(WORKERS, name)
    info = json.loads(raw) if raw else None
    return info is not None and info["heartbeat_at"] > since and info["in_flight"] == in_flight


def stream_text(url: str, rid: str, out: dict[str, str]) -> None:
    """Follow the SSE stream of one request, joining its delta texts. A stream refused with 503
    (Redis away: a failover, a restart) is opened again after its Retry-After, as a client does."""
    text: list[str] = []
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=url, timeout=120) as client:
        while True:
            with client.stream("GET", f"/v1/requests/{rid}/events") as response:
                if response.status_code == 503 and time.monotonic() < deadline:
                    time.sleep(float(response.headers.get("Retry-After", "1")))
                    continue
                for ev in events(response.iter_lines()):
                    if ev.event == "delta":
                        text.append(ev.json()["text"])
                    elif ev.event in ("done", "error"):
                        break
                break
    out[rid] = "".join(text)


def test_sigkill_a_worker_mid_generation(cluster: Cluster) -> None:
    cluster.start_worker("a")
    cluster.start_worker("b")
    cluster.wait_workers(2)
    rids, _ = submit(cluster, 24, max_tokens=120)
    streamed: dict[str, str] = {}
    readers = [threading.Thread(target=stream_text, args=(cluster.url, rid, streamed)) for rid in rids]
    for t in readers:
        t.start()
    r = cluster.sync()
    owned_by_a = kill_mid_generation(cluster, "a", rids)  # what a held mid-way at the kill, exactly
    killed_at = time.monotonic()
    wait_final(cluster, rids)
    recovery = time.monotonic() - killed_at
    for t in readers:
        t.join(30)
    figures = audit(cluster, rids)
    record("SIGKILL worker mid-generation", 24, len(rids), figures, recovery)
    assert figures == {"completed": 24, "duplicated": 0, "lost": 0}
    expected = "".join(f" t{i}" for i in range(120))
    for rid in rids:
        status = r.hgetall(KEYS.status(rid))
        assert json.loads(status["result"])["output"]["text"] == expected
        assert streamed[rid] == expected, f"{rid} streamed {streamed[rid]!r}"  # no repeated tokens
    assert all(json.loads(r.hget(KEYS.status(rid), "result"))["attempt"] == 2 for rid in owned_by_a)


def test_sigstop_past_the_lease_is_fenced_out(cluster: Cluster) -> None:
    cluster.start_worker("a", SLUICE_NULL_TOKEN_DELAY_S="0.05")
    cluster.wait_workers(1)
    (rid,), _ = submit(cluster, 1, max_tokens=60)  # 3 s of generation
    r = cluster.sync()
    deadline = time.monotonic() + 10
    while r.hget(KEYS.status(rid), "state") != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stopped_at = time.monotonic()
    cluster.signal("a", signal.SIGSTOP)
    cluster.start_worker("b")
    wait_final(cluster, [rid], timeout_s=30)
    recovery = time.monotonic() - stopped_at
    result = json.loads(r.hget(KEYS.status(rid), "result"))
    assert result["status"] == "done" and result["attempt"] == 2
    resumed_at = time.time()
    cluster.signal("a", signal.SIGCONT)  # the stale worker wakes up holding a request it lost
    # Until it lets go of the request (its lease refresh finds it fenced, or its commit is
    # refused), its heartbeats count it in flight: wait for one that does not.
    wait_until(lambda: _heartbeat_since(r, "a", resumed_at, in_flight=0), "worker a letting go of the lost request",
               timeout_s=60)
    finals = [f for _, f in r.xrange(KEYS.reply(rid)) if f.get("kind") == "final"]
    assert len(finals) == 1
    assert json.loads(r.hget(KEYS.status(rid), "result")) == result
    assert cluster.workers["a"].poll() is None  # fenced out, not crashed
    record("SIGSTOP worker past the lease, SIGCONT", 1, 1, audit(cluster, [rid]), recovery)


def test_final_written_but_not_acknowledged_is_not_run_again(cluster: Cluster) -> None:
    # A worker that wrote the final result and died before acknowledging (the commit is one
    # Lua script, so Sluice cannot crash there; this builds that state by hand): the entry is
    # pending for a dead consumer while its result exists. Reclaiming it must not run it again.
    (rid,), _ = submit(cluster, 1, max_tokens=5)
    r = cluster.sync()
    r.xgroup_create(KEYS.requests, "workers", id="0", mkstream=True)  # no worker has started yet
    got = r.xreadgroup("workers", "dead", {KEYS.requests: ">"}, count=1)
    entry_id = got[0][1][0][0]
    final = {"status": "done", "output": {"text": " earlier", "num_output_tokens": 1}, "attempt": 1}
    r.xadd(KEYS.reply(rid), {"kind": "final", "data": json.dumps(final)})
    r.hset(KEYS.status(rid), mapping={"state": "done", "result": json.dumps(final)})
    started = time.monotonic()
    cluster.start_worker("b")
    deadline = time.monotonic() + 20
    while r.xlen(KEYS.requests):
        assert time.monotonic() < deadline, "the orphaned entry was never reclaimed"
        time.sleep(0.1)
    assert not r.xpending_range(KEYS.requests, "workers", "-", "+", 10)
    figures = audit(cluster, [rid])
    record("final written, not acknowledged", 1, 1, figures, time.monotonic() - started)
    assert figures["duplicated"] == 0
    assert json.loads(r.hget(KEYS.status(rid), "result"))["output"]["text"] == " earlier"
    assert entry_id


def test_kill_9_redis_with_50_queued(cluster: Cluster) -> None:
    cluster.start_worker("a")
    cluster.wait_workers(1)
    cluster.restart_redis()  # an idle worker and the api reconnect by themselves
    (rids_before, _) = submit(cluster, 2, max_tokens=3)
    wait_final(cluster, rids_before, timeout_s=30)
    assert audit(cluster, rids_before)["completed"] == 2
    cluster.signal("a", signal.SIGSTOP)  # hold the queue
    rids, _ = submit(cluster, 50, max_tokens=5)
    assert queued(cluster.sync(), KEYS.requests) == 50
    time.sleep(1.5)  # appendfsync everysec: what was acknowledged a second ago is on disk
    down = cluster.restart_redis()
    restarted = time.monotonic()
    assert queued(cluster.sync(), KEYS.requests) == 50
    cluster.signal("a", signal.SIGCONT)
    wait_final(cluster, rids, timeout_s=60)
    figures = audit(cluster, rids)
    record("kill -9 Redis (AOF) with 50 queued", 50, 50, figures, down + time.monotonic() - restarted)
    assert figures == {"completed": 50, "duplicated": 0, "lost": 0}


def test_poison_request_ends_in_the_dead_letter_stream(cluster: Cluster) -> None:
    crash = {"SLUICE_NULL_CRASH_ON": "POISON", "SLUICE_MAX_DELIVERIES": "3"}
    cluster.start_worker("a", **crash)
    cluster.wait_workers(1)
    (rid,), _ = submit(cluster, 1, prompt="POISON")
    good, _ = submit(cluster, 3, max_tokens=3)
    r = cluster.sync()
    started = time.monotonic()
    crashes = crash_until_final(cluster, rid, **crash)  # a process manager restarts crashed workers
    status = r.hgetall(KEYS.status(rid))
    error = json.loads(status["result"])["error"]
    # fresh, retried together with the three good ones, about log2(4) halvings, then its
    # max_deliveries - 1 runs in a group of one crash and the next delivery (one too) is dead-lettered
    assert status["state"] == "failed" and "3 of them in a quarantine group of one" in error, error
    assert 4 <= crashes <= 2 + math.ceil(math.log2(4)) + 2, crashes
    (entry,) = r.xrange(KEYS.dead_letters)
    assert entry[1]["id"] == rid and int(entry[1]["attempts"]) > crashes
    assert f"no result after {entry[1]['attempts']} deliveries" in error, error
    wait_final(cluster, good)
    figures = audit(cluster, good)
    record("request that always crashes its worker", 4, 4, figures, time.monotonic() - started)
    assert figures == {"completed": 3, "duplicated": 0, "lost": 0}
    listed = subprocess.run([sys.executable, "-m", "sluice.cli", "dlq", "list", "--model", MODEL],
                            env=cluster.env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and rid in listed.stdout, listed.stderr


def test_200_submissions_against_a_bound_of_50(cluster: Cluster) -> None:
    # The bound is read by the api at admission; restart it with the new setting.
    cluster.api.send_signal(signal.SIGTERM)
    cluster.api.wait(30)
    cluster.env["SLUICE_MAX_QUEUED"] = "50"
    cluster.start_api()
    from tests.faults.conftest import _wait_api

    _wait_api(cluster)
    cluster.start_worker("a", SLUICE_NULL_TOKEN_DELAY_S="0.01")
    cluster.wait_workers(1)
    # Held while the 200 arrive: a worker draining as fast as a loaded machine submits would
    # keep the queue under its bound (CI once accepted all 200).
    cluster.signal("a", signal.SIGSTOP)
    with ThreadPoolExecutor(16) as pool:
        parts = list(pool.map(lambda _: submit(cluster, 25, max_tokens=10), range(8)))
    cluster.signal("a", signal.SIGCONT)
    rids = [rid for accepted, _ in parts for rid in accepted]
    refused = sum(n for _, n in parts)
    assert len(rids) + refused == 200 and len(rids) == 50, (len(rids), refused)
    started = time.monotonic()
    wait_final(cluster, rids)
    figures = audit(cluster, rids)
    record("200 submissions, bound 50", 200, len(rids), figures, time.monotonic() - started)
    assert figures == {"completed": len(rids), "duplicated": 0, "lost": 0}


def test_expired_requests_never_reach_the_engine(cluster: Cluster) -> None:
    cluster.start_worker("a")
    cluster.wait_workers(1)
    cluster.signal("a", signal.SIGSTOP)
    rids, _ = submit(cluster, 5, max_tokens=3, timeout_s=0.5)
    time.sleep(1.0)
    cluster.signal("a", signal.SIGCONT)
    wait_final(cluster, rids, timeout_s=30)
    r = cluster.sync()
    assert [r.hget(KEYS.status(rid), "state") for rid in rids] == ["expired"] * 5
    logged = {json.loads(f["data"])["request_id"] for _, f in r.xrange(KEYS.log)}
    assert not logged & set(rids)  # never run: no inference-log record
    assert all(r.hget(KEYS.status(rid), "started_at") is None for rid in rids)
    record("expired before start", 5, 5, {"completed": 0, "duplicated": 0, "lost": 0}, None)


def test_sigterm_during_load_loses_nothing(cluster: Cluster) -> None:
    cluster.start_worker("a")
    cluster.start_worker("b")
    cluster.wait_workers(2)
    rids, _ = submit(cluster, 60, max_tokens=30)
    r = cluster.sync()
    # Stop a while it is running work (the check below wants both workers to have run some).
    wait_until(lambda: any(r.hget(KEYS.status(rid), "worker") == "a" for rid in rids), "worker a running work")
    stopped_at = time.monotonic()
    cluster.signal("a", signal.SIGTERM)
    assert cluster.workers["a"].wait(60) == 0
    wait_final(cluster, rids)
    figures = audit(cluster, rids)
    record("SIGTERM a worker during load", 60, 60, figures, time.monotonic() - stopped_at)
    assert figures == {"completed": 60, "duplicated": 0, "lost": 0}
    assert {r.hget(KEYS.status(rid), "worker") for rid in rids} == {"a", "b"}


def test_a_long_generation_on_a_live_worker_is_never_reclaimed(cluster: Cluster) -> None:
    slow = {"SLUICE_NULL_TOKEN_DELAY_S": "0.05"}
    cluster.start_worker("a", **slow)
    cluster.start_worker("b", **slow)
    cluster.wait_workers(2)
    started = time.monotonic()
    rids, _ = submit(cluster, 4, max_tokens=120)  # 6 s each, three lease timeouts
    wait_final(cluster, rids, timeout_s=60)
    r = cluster.sync()
    results = [json.loads(r.hget(KEYS.status(rid), "result")) for rid in rids]
    assert [x["status"] for x in results] == ["done"] * 4
    assert [x["attempt"] for x in results] == [1] * 4
    record("generation longer than the lease", 4, 4, audit(cluster, rids), time.monotonic() - started)


def test_dead_letters_can_be_retried_and_dropped(cluster: Cluster) -> None:
    crash = {"SLUICE_NULL_CRASH_ON": "POISON", "SLUICE_MAX_DELIVERIES": "1"}
    cluster.start_worker("a", **crash)
    cluster.wait_workers(1)
    rids, _ = submit(cluster, 2, prompt="POISON", max_tokens=3)
    r = cluster.sync()
    deadline = time.monotonic() + 60
    while r.xlen(KEYS.dead_letters) < 2:
        assert time.monotonic() < deadline
        if cluster.workers["a"].poll() is not None:
            cluster.start_worker("a", **crash)
        time.sleep(0.1)
    cluster.signal("a", signal.SIGTERM)
    cluster.workers["a"].wait(30)
    cluster.start_worker("healthy")  # an engine that survives the request this time
    cli = [sys.executable, "-m", "sluice.cli", "dlq"]
    retried = subprocess.run([*cli, "retry", rids[0], "--model", MODEL], env=cluster.env,
                             capture_output=True, text=True, timeout=60)
    assert retried.returncode == 0 and rids[0] in retried.stdout, retried.stderr
    dropped = subprocess.run([*cli, "drop", "--all", "--model", MODEL], env=cluster.env,
                             capture_output=True, text=True, timeout=60)
    assert dropped.returncode == 0 and rids[1] in dropped.stdout, dropped.stderr
    wait_final(cluster, rids[:1], timeout_s=30)
    assert r.hget(KEYS.status(rids[0]), "state") == "done"
    assert r.hget(KEYS.status(rids[1]), "state") == "failed"
    assert r.xlen(KEYS.dead_letters) == 0


def test_a_wiped_redis_gets_its_groups_and_models_back(cluster: Cluster) -> None:
    cluster.start_worker("a")
    cluster.wait_workers(1)
    cluster.sync().flushall()  # Redis restarted without its data
    wiped_at = time.monotonic()
    deadline = time.monotonic() + 30
    while True:  # the api re-registers the models of its models file on first use
        with httpx.Client(base_url=cluster.url, timeout=10) as client:
            r = client.post("/v1/requests", json={"prompt": "after the wipe", "max_tokens": 3})
        if r.status_code == 202:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    rid = r.json()["id"]
    wait_final(cluster, [rid], timeout_s=30)
    figures = audit(cluster, [rid])
    record("Redis wiped (no AOF): groups re-created", 1, 1, figures, time.monotonic() - wiped_at)
    assert figures == {"completed": 1, "duplicated": 0, "lost": 0}
