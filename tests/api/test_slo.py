"""A model's TTFT target at the door: once its lane holds as many requests as its workers can
start within the target, the next is refused at once with 503 and Retry-After (nothing
enqueued), instead of being served late; the bulk lane, models without a target and workers
that do not know their rate yet are not bound by it."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.registry import WorkerInfo, WorkerRegistry
from tests.api.conftest import StartApi, http_client
from tests.broker.helpers import MODEL, queued_len

SLO_MODELS = f"""models:
  - name: {MODEL}
    continuous_batching_config: {{max_concurrent_batch_size: 8}}
    slo: {{ttft_ms: 1500, tpot_ms: 100}}
  - name: free
"""


async def beat(redis: Redis, name: str, *, admitted: int, rate: float, model: str = MODEL) -> None:
    now = time.time()
    await WorkerRegistry(redis).beat(WorkerInfo(name=name, model=model, version=1, mode="continuous", pid=1,
                                                host="h", in_flight=0, capacity=8, started_at=now,
                                                heartbeat_at=now, admitted=admitted, service_rate=rate))


def body(model: str = MODEL, **extra: object) -> dict:
    return {"model": model, "prompt": "hello", "max_tokens": 4, **extra}


async def test_past_what_can_start_within_the_target_requests_are_refused_at_once(
        redis: Redis, start_api: StartApi) -> None:
    # Two workers: 3 + 1 slots, finishing 1.0 + 1.0 requests/s: 4 start at once, and in 1.5 s
    # the queue behind them drains by 3. So the lane holds 7 before one would start late.
    await beat(redis, "w1", admitted=3, rate=1.0)
    await beat(redis, "w2", admitted=1, rate=1.0)
    async with start_api(SLO_MODELS) as app, http_client(app) as api:
        accepted = [await api.post("/v1/requests", json=body()) for _ in range(7)]
        assert [r.status_code for r in accepted] == [202] * 7
        refused = await api.post("/v1/requests", json=body())
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "time-to-first-token target (1500 ms, slo.ttft_ms)" in message and "7 requests are ahead" in message
        assert refused.headers["Retry-After"] == "1"  # one over, at 2/s
        assert await queued_len(redis, ModelKeys(MODEL).requests) == 7  # nothing of the refused one enqueued

        # Three choices in one call, two over the bound: all refused, waiting about 1.5 s.
        many = await api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 3})
        assert many.status_code == 503 and many.headers["Retry-After"] == "2"

        # Bulk work (priority above 0) has no TTFT target: still within its own share.
        assert (await api.post("/v1/requests", json=body(priority=1))).status_code == 202
        # Another model without a target: only the queue bound.
        assert all([(await api.post("/v1/requests", json=body("free"))).status_code == 202 for _ in range(9)])
        metrics = (await api.get("/metrics")).text
        assert f'sluice_requests_rejected_total{{model="{MODEL}",reason="slo"}} 4.0' in metrics


async def test_workers_that_do_not_know_their_rate_yet_set_no_bound(redis: Redis, start_api: StartApi) -> None:
    await beat(redis, "fresh", admitted=1, rate=0.0)  # nothing finished since it started
    async with start_api(SLO_MODELS) as app, http_client(app) as api:
        assert [(await api.post("/v1/requests", json=body())).status_code for _ in range(12)] == [202] * 12


async def test_a_faster_model_admits_more(redis: Redis, start_api: StartApi) -> None:
    await beat(redis, "w1", admitted=2, rate=10.0)  # 2 + 15 within 1.5 s
    async with start_api(SLO_MODELS) as app, http_client(app) as api:
        codes = [(await api.post("/v1/requests", json=body())).status_code for _ in range(18)]
        assert codes == [202] * 17 + [503]
