"""Issue 28 defect 7: a request of a model that has no live worker ends `expired` at its deadline
(it once stayed queued until its status expired, then answered 410), and a model removed from the
models file stops taking requests (it once stayed deployed and kept answering 202)."""

from __future__ import annotations

from redis.asyncio import Redis

from tests.api.conftest import MODELS_YAML, StartApi, http_client
from tests.broker.helpers import KEYS


async def test_a_request_without_a_worker_expires_at_its_deadline(redis: Redis, start_api: StartApi) -> None:
    async with start_api(expire_interval_s=0.05) as app, http_client(app) as api:
        submitted = await api.post("/v1/requests", json={"prompt": "hi", "max_tokens": 3, "timeout_s": 0.2})
        assert submitted.status_code == 202, submitted.text
        rid = submitted.json()["id"]
        polled = await api.get(f"/v1/requests/{rid}", params={"wait": 30})  # returns once final
        assert polled.status_code == 200, polled.text
        assert polled.json()["status"] == "expired", polled.text
        assert "deadline" in polled.json()["error"]
        assert await redis.xlen(KEYS.requests) == 0


async def test_a_model_removed_from_the_models_file_takes_no_more_requests(
        redis: Redis, start_api: StartApi) -> None:
    two = MODELS_YAML + "  - name: gone\n    batch_config: single\n"
    async with start_api(two) as app, http_client(app) as api:
        assert (await api.post("/v1/requests", json={"model": "gone", "prompt": "hi"})).status_code == 202
    async with start_api(MODELS_YAML) as app, http_client(app) as api:
        refused = await api.post("/v1/requests", json={"model": "gone", "prompt": "hi"})
        assert refused.status_code == 404, refused.text
        assert (await api.post("/v1/requests", json={"model": KEYS.model, "prompt": "hi"})).status_code == 202
