"""The operator dashboard: its data route against the tests' Redis (queues, workers, activity from
the inference log, dead letters, bulk jobs, who may read it), the per-minute statistics on their
own, and the page itself (self-contained, locked down by its Content-Security-Policy)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from pathlib import Path

import httpx
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.api.activity import ActivityReader, percentile, recent_failures, window_stats
from sluice.broker.activity import LogWindow
from sluice.broker.webhooks.deliveries import Deliveries
from sluice.broker.webhooks.endpoints import EndpointStore
from sluice.config.settings import Settings
from sluice.workers.worker import Worker
from tests.api.keyed_app import ADMIN, ALICE, client, keyed_app
from tests.api.test_request_path import WAIT_S, eventually, submit
from tests.broker.helpers import KEYS, MODEL, done_result, fetch_one, ready_consumer


async def dashboard(api: httpx.AsyncClient) -> dict:
    r = await api.get("/v1/dashboard")
    assert r.status_code == 200, r.text
    return r.json()


def model_of(data: dict) -> dict:
    (m,) = [m for m in data["models"] if m["name"] == MODEL]
    return m


async def test_queue_depth_counts_the_requests_no_worker_takes(api: httpx.AsyncClient) -> None:
    empty = model_of(await dashboard(api))
    assert empty["queue"]["interactive"] == {"waiting": 0, "running": 0, "oldest_waiting_s": 0.0}
    assert empty["workers"] == [] and empty["capacity"] == 0 and empty["recent_failures"] == []
    assert empty["activity"]["log_since"] is None
    assert all(w["requests"] == 0 and w["data"] for w in empty["activity"]["minutes"])  # no traffic: zero
    for _ in range(3):
        await submit(api)
    data = await dashboard(api)
    m = model_of(data)
    assert m["queue"]["interactive"]["waiting"] == 3 and m["queue"]["bulk"]["waiting"] == 0
    assert m["queue"]["interactive"]["running"] == 0 and m["queue"]["interactive"]["oldest_waiting_s"] >= 0
    assert m["version"] == 1 and m["mode"] == "continuous" and m["max_queued"] > 0
    assert len(m["activity"]["minutes"]) == data["minutes"] == 10
    assert data["batches"] == [] and data["other_workers"] == []


async def test_a_running_request_is_running_not_waiting(api: httpx.AsyncClient, redis: Redis,
                                                        settings: Settings) -> None:
    """One running request: 0 waiting, 1 running, nothing waiting for any time (the page once
    said "1 queued, 1 in flight, oldest waiting 2.0 s"), on the dashboard, /v1/models/{model}
    and the metrics alike."""
    rid = await submit(api)
    c = await ready_consumer(redis, settings, "dash-w1")
    d = await fetch_one(c)
    assert d.message.id == rid and await c.start(d) == "run"
    await submit(api)  # and one that waits
    nothing = {"waiting": 0, "running": 0, "oldest_waiting_s": 0.0}
    m = model_of(await dashboard(api))
    assert m["queue"]["interactive"]["waiting"] == 1 and m["queue"]["interactive"]["running"] == 1
    assert m["queue"]["bulk"] == nothing
    shown = (await api.get(f"/v1/models/{MODEL}")).json()["queue"]
    assert shown["interactive"]["waiting"] == 1 and shown["interactive"]["running"] == 1
    assert shown["bulk"] == nothing and shown["max_queued"] == m["max_queued"]
    metrics = (await api.get("/metrics")).text
    assert f'sluice_queue_depth{{lane="interactive",model="{MODEL}"}} 1.0' in metrics
    assert f'sluice_queue_running{{lane="interactive",model="{MODEL}"}} 1.0' in metrics
    assert await c.commit(d, done_result())
    m = model_of(await dashboard(api))
    assert m["queue"]["interactive"]["waiting"] == 1 and m["queue"]["interactive"]["running"] == 0


async def test_a_dead_letter_appears(api: httpx.AsyncClient, redis: Redis, settings: Settings) -> None:
    rid = await submit(api)
    c = await ready_consumer(redis, settings, "dash-w1")
    d = await fetch_one(c)
    assert await c.dead_letter(d.stream, d.entry_id, rid, d.message.model_dump_json(), "engine crashed", 3)
    m = model_of(await dashboard(api))
    assert m["dead_letters"]["count"] == 1
    (letter,) = m["dead_letters"]["recent"]
    assert letter["request_id"] == rid and letter["error"] == "engine crashed"
    assert letter["attempts"] == 3 and letter["lane"] == "interactive"
    assert m["queue"]["interactive"] == {"waiting": 0, "running": 0, "oldest_waiting_s": 0.0}  # off the stream


async def test_activity_workers_and_failures_from_real_traffic(api: httpx.AsyncClient, null_worker: Worker) -> None:
    rids = [await submit(api, max_tokens=3) for _ in range(4)]
    for rid in rids:
        assert (await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})).json()["status"] == "done"
    long = await submit(api, max_tokens=8000)

    async def running() -> bool:
        return (await api.get(f"/v1/requests/{long}")).json()["status"] == "running"

    await eventually(running, what="the long request to start")
    assert (await api.delete(f"/v1/requests/{long}")).status_code == 202
    assert (await api.get(f"/v1/requests/{long}", params={"wait": WAIT_S})).json()["status"] == "cancelled"

    async def logged() -> bool:  # the log is written after the request's final
        return model_of(await dashboard(api))["activity"]["last_minute"]["requests"] == 5

    await eventually(logged, what="five requests in the inference log")
    m = model_of(await dashboard(api))
    last = m["activity"]["last_minute"]
    # The client's own cancel is counted, apart: it is no failure.
    assert last["data"] and not last["sampled"] and last["failed"] == 0 and last["cancelled"] == 1
    assert last["requests_per_s"] > 0 and last["tokens_per_s"] > 0
    assert 0 < last["e2e_p50_s"] <= last["e2e_p95_s"] < WAIT_S
    assert last["ttft_p50_s"] is not None and last["queue_p50_s"] is not None
    assert m["activity"]["log_since"] is not None
    assert sum(w["requests"] or 0 for w in m["activity"]["minutes"][-2:]) == 5  # this minute and the one before
    assert m["recent_failures"] == []
    (worker,) = m["workers"]
    assert worker["name"] == "api-test-worker" and worker["capacity"] == 4 and worker["state"] == "running"
    assert m["capacity"] == 4 and 0 <= m["in_flight"] <= 4


async def test_running_bulk_jobs_are_listed_with_their_progress(app: FastAPI, api: httpx.AsyncClient) -> None:
    jobs = app.state.sluice.jobs
    batch = await jobs.create("file-abc", "/v1/chat/completions", "24h", None)
    data = await dashboard(api)
    (shown,) = data["batches"]
    assert shown["id"] == batch["id"] and shown["status"] == "validating" and shown["progress"] is None
    await jobs.move(batch["id"], "cancelled", ["validating"])
    assert (await dashboard(api))["batches"] == []  # final: not shown


async def test_webhook_deliveries_by_outcome_backlog_and_dead_letters(api: httpx.AsyncClient, redis: Redis) -> None:
    """Deliveries settled through Deliveries (as a sender settles them): counted by outcome over
    the last minutes; what is not done is the backlog, with its oldest event's age."""
    assert (await dashboard(api))["webhooks"] == {"endpoints": 0, "minutes": 10, "backlog": 0, "dead": 0,
                                                  "oldest_pending_s": 0.0, "outcomes": {
                                                      "delivered": 0, "retried": 0, "dead": 0, "dropped": 0}}
    endpoint = await EndpointStore(redis).create("http://127.0.0.1:9/hooks", [], owner="")
    deliveries = Deliveries(redis)
    await deliveries.enqueue([(endpoint.id, f"msg_{i}", "{}") for i in range(4)], lease_s=0)
    ok, retried, dead, dropped = await deliveries.claim(4, 30)
    await deliveries.settle(ok, "ok")
    await deliveries.settle(retried, "retry", next_at=time.time() + 60, error="HTTP 500")
    await deliveries.settle(dead, "dead", error="HTTP 500")
    await deliveries.settle(dropped, "ok", counted="dropped")
    await deliveries.settle(ok, "ok")  # settled already (another sender): not counted twice
    w = (await dashboard(api))["webhooks"]
    assert w["outcomes"] == {"delivered": 1, "retried": 1, "dead": 1, "dropped": 1}
    assert w["endpoints"] == 1 and w["backlog"] == 1 and w["dead"] == 1 and w["oldest_pending_s"] >= 0


async def test_only_an_admin_key_reads_the_data(settings: Settings, tmp_path: Path, redis: Redis) -> None:
    async with keyed_app(settings, tmp_path) as app:
        async with client(app, None) as anonymous, client(app, ALICE) as user, client(app, ADMIN) as admin:
            assert (await anonymous.get("/v1/dashboard")).status_code == 401
            assert (await user.get("/v1/dashboard")).status_code == 403
            assert (await admin.get("/v1/dashboard")).status_code == 200
            assert (await anonymous.get("/dashboard")).status_code == 200  # the page itself: no key


async def test_the_page_is_self_contained_and_locked_down(api: httpx.AsyncClient) -> None:
    r = await api.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "v1/dashboard" in page and "sessionStorage" in page
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I), "an external asset"
    assert not re.search(r"@import|url\(", page), "an external stylesheet or font"
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    (script,) = re.findall(r"<script>(.*?)</script>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp  # the page's own script, and only it, may run
    assert r.headers["x-content-type-options"] == "nosniff"


def window(records: list[tuple[float, dict]], sampled: bool = False, start: float = 1000.0) -> LogWindow:
    return LogWindow(start, start + 60, records, sampled)


def record(rid: str, status: str = "done", *, e2e: float = 1.0, tokens: int = 10, row: int = 0) -> dict:
    return {"request_id": rid, "row": row, "status": status, "output": {"num_output_tokens": tokens},
            "timings": {"enqueued": 0.0, "started": e2e / 4, "first_token": e2e / 2, "finished": e2e}}


def test_a_cancel_is_no_failure() -> None:
    records = [(1050.0, record("ok")), (1051.0, record("gone", "cancelled", tokens=1)),
               (1052.0, record("bad", "failed", tokens=0)), (1053.0, record("late", "expired", tokens=0))]
    s = window_stats(window(records), first_at=900.0)
    assert s["requests"] == 4 and s["failed"] == 2 and s["cancelled"] == 1
    assert [f["request_id"] for f in recent_failures([window(records)])] == ["bad", "late"]
    assert window_stats(window([]), first_at=1100.0)["cancelled"] is None  # no data: unknown


def test_window_stats_count_requests_once_and_take_percentiles() -> None:
    records = [(1050.0, record(f"r{i}", e2e=float(i + 1))) for i in range(20)]
    records += [(1051.0, record("r0", row=1)), (1052.0, record("bad", "failed", tokens=0))]
    s = window_stats(window(records), first_at=900.0)
    assert s["requests"] == 21 and s["failed"] == 1  # r0's second row is the same request
    assert s["requests_per_s"] == round(21 / 60, 3) and s["tokens_per_s"] == round(210 / 60, 1)
    assert s["e2e_p50_s"] == 10.0 and s["e2e_p95_s"] == 19.0 and s["ttft_p50_s"] == 5.0 and s["queue_p95_s"] == 4.75
    assert s["data"] and not s["partial"] and not s["sampled"]


def test_a_capped_sample_is_scaled_to_its_window() -> None:
    # 10 records read (the cap), spanning the last 6 s of the 60 s window: about 100 in all
    records = [(1054.0 + i * 0.6, record(f"r{i}")) for i in range(10)]
    s = window_stats(window(records, sampled=True), first_at=None)
    assert s["sampled"] and s["requests"] == 100 and s["requests_per_s"] == round(100 / 60, 3)


def test_a_window_the_log_does_not_reach_has_no_data() -> None:
    s = window_stats(window([]), first_at=1100.0)  # the log begins after the window
    assert not s["data"] and s["requests"] is None and s["e2e_p95_s"] is None
    partial = window_stats(window([(1059.0, record("r"))]), first_at=1030.0)
    assert partial["data"] and partial["partial"] and partial["requests"] == 1
    assert partial["requests_per_s"] == round(1 / 30, 3)  # over the 30 s the log covers
    assert window_stats(window([]), first_at=None)["requests"] == 0  # an empty log: no traffic at all


def test_the_part_of_a_sample_since_a_time() -> None:
    full = window([(1050.0, record("a")), (1020.0, record("b"))])
    assert [r["request_id"] for _, r in full.since(1030.0).records] == ["a"] and not full.since(1030.0).sampled
    capped = window([(1050.0, record("a")), (1040.0, record("b"))], sampled=True)
    assert capped.since(1030.0).sampled  # the read did not reach back to 1030: more may be missing
    assert not capped.since(1045.0).sampled and capped.since(1045.0).start == 1045.0


async def test_minutes_that_are_over_are_read_once(redis: Redis) -> None:
    t0 = 1_700_000_040.0  # a minute's start
    for at, rid in ((t0 - 100, "r1"), (t0 + 10, "r2")):
        await redis.xadd(KEYS.log, {"data": json.dumps(record(rid))}, id=f"{int(at * 1000)}-0")
    reader = ActivityReader(redis, ttl_s=0)
    first = await reader.read(MODEL, now=t0 + 30)
    assert [m["requests"] for m in first["minutes"]] == [None] * 7 + [1, 0, 1]
    assert first["minutes"][7]["partial"] and first["log_since"] == t0 - 100
    assert first["last_minute"]["requests"] == 1  # r2 only: r1 is 130 s old
    await redis.xtrim(KEYS.log, maxlen=0)  # the log trimmed: the minutes over keep what was read
    again = await reader.read(MODEL, now=t0 + 31)
    assert [m["requests"] for m in again["minutes"]] == [None] * 7 + [1, 0, 0]
    assert again["log_since"] is None and again["last_minute"]["requests"] == 0


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([float(x) for x in range(1, 101)], 0.95) == 95.0
