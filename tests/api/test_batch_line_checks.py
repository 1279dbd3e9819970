"""A batch line passes the checks of the route it names (issue 29, finding 5): a body that
/v1/completions or /v1/chat/completions refuses, sent as a batch line, ends in the batch's error
file with the route's message, and never reaches a queue. The model has a tokenizer that the
api and the jobs worker can both read (100 words, a 4096-token context), so the token count
against the context is checked as well as the prompt's length in characters, and so are the
sampling values the engine would refuse (finding 13's, at the routes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.broker.jobs.files import FileStore
from sluice.broker.jobs.store import JobStore
from sluice.broker.keys import ModelKeys
from sluice.workers.jobs.runner import JobRunner
from tests.api.conftest import StartApi, http_client
from tests.api.test_batches import Jobs
from tests.api.test_model_bounds import REFUSED, tiny_model

HUGE = "w1 " * 500_000  # 1.5 M characters, 500,000 tokens


def completion(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}


def chat(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


# (the route's prompt limit in characters, the prompt, max_tokens, the status the route answers, the error line's code)
CASES = [
    (None, HUGE, 5000, 413, "prompt_too_long"),  # the default limit (200,000 characters)
    (2_000_000, HUGE, 5000, 400, "context_length_exceeded"),  # under a raised one: its tokens
    (None, "w1 w2", 5000, 400, "context_length_exceeded"),  # 2 tokens, but max_tokens past the context
]


@pytest.fixture
async def app(start_api: StartApi, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[FastAPI]:
    models_yaml = (f"models:\n  - name: tiny\n    path: {tiny_model(tmp_path / 'tiny')}\n"
                   "    default_max_tokens: 16\n    continuous_batching_config: {max_concurrent_batch_size: 4}\n")
    limit = request.param
    async with start_api(models_yaml, **({"max_prompt_chars": limit} if limit else {})) as built:
        built.state.sluice.celery = Jobs()
        yield built


async def run_batch(app: FastAPI, api: httpx.AsyncClient, redis: Redis, endpoint: str,
                    bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """The bodies as one batch's lines, created through the api and run by a jobs worker's runner."""
    lines = [json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": endpoint, "body": body})
             for i, body in enumerate(bodies)]
    r = await api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())},
                       data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    r = await api.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": endpoint})
    assert r.status_code == 200, r.text
    settings = app.state.sluice.settings
    await asyncio.wait_for(JobRunner(settings, redis, r.json()["id"], poll_s=0.01).run(), timeout=120)
    return await JobStore(redis).get(r.json()["id"])


@pytest.mark.parametrize(("app", "prompt", "max_tokens", "status", "code"), CASES,
                         indirect=["app"], ids=["1.5M-chars", "1.5M-chars-limit-raised", "max-tokens-past-context"])
async def test_a_line_the_route_refuses_ends_in_the_error_file_with_the_routes_error(
        app: FastAPI, redis: Redis, prompt: str, max_tokens: int, status: int, code: str) -> None:
    settings = app.state.sluice.settings
    async with http_client(app) as api:
        for url, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            refused = await api.post(url, json=body(prompt, max_tokens))
            assert refused.status_code == status, refused.text
            message = refused.json()["error"]["message"]
            assert refused.json()["error"]["param"] in ("prompt", "messages"), refused.text
            batch = await run_batch(app, api, redis, url, [body(prompt, max_tokens)])
            assert batch["status"] == "completed", batch
            assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}, batch
            assert batch["output_file_id"] is None
            path = FileStore(redis, settings.files_path, settings.max_file_bytes).path(batch["error_file_id"])
            (error,) = map(json.loads, path.read_text().splitlines())
            assert error["error"] == {"code": code, "message": f"line 1: {message}"}, error
            # Nothing reached a queue: neither the route's request nor the batch's line.
            keys = ModelKeys("tiny")
            assert await redis.xlen(keys.requests) == 0 and await redis.xlen(keys.bulk) == 0


@pytest.mark.parametrize("app", [None], indirect=True)
async def test_sampling_values_the_route_refuses_end_in_the_error_file_with_its_error(
        app: FastAPI, redis: Redis) -> None:
    settings = app.state.sluice.settings
    async with http_client(app) as api:
        for url, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            bodies = [{**body("w1 w2", 16), **extra} for extra, _ in REFUSED]
            expected = {}
            for i, (b, (_, field)) in enumerate(zip(bodies, REFUSED)):
                refused = await api.post(url, json=b)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
                expected[f"row-{i}"] = {"code": field, "message": f"line {i + 1}: {refused.json()['error']['message']}"}
            batch = await run_batch(app, api, redis, url, bodies)
            assert batch["status"] == "completed", batch
            assert batch["request_counts"] == {"total": len(REFUSED), "completed": 0, "failed": len(REFUSED)}, batch
            path = FileStore(redis, settings.files_path, settings.max_file_bytes).path(batch["error_file_id"])
            errors = {e["custom_id"]: e["error"] for e in map(json.loads, path.read_text().splitlines())}
            assert errors == expected
            keys = ModelKeys("tiny")
            assert await redis.xlen(keys.requests) == 0 and await redis.xlen(keys.bulk) == 0
