"""Values the engine would refuse are refused by the api, naming the field (issue 29, finding 13),
and /tokenize has the prompt limit of the routes that queue (finding 15). The model here has a
tokenizer the api can read: 100 words, so token ids 0 to 99."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis
from tokenizers import Tokenizer, models, pre_tokenizers

from sluice.broker.keys import ModelKeys
from tests.api.conftest import StartApi, http_client

VOCAB = 100
PROMPT_LIMIT = 1000


def tiny_model(directory: Path) -> Path:
    directory.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return directory


@pytest.fixture
async def app(start_api: StartApi, tmp_path: Path) -> AsyncIterator[FastAPI]:
    models_yaml = (f"models:\n  - name: tiny\n    path: {tiny_model(tmp_path / 'tiny')}\n"
                   "    default_max_tokens: 16\n    continuous_batching_config: {max_concurrent_batch_size: 4}\n")
    async with start_api(models_yaml, max_wait_s=0.05, max_prompt_chars=PROMPT_LIMIT) as built:
        yield built


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(app) as client:
        yield client


ROUTES = [
    ("/v1/completions", {"model": "tiny", "prompt": "w1 w2"}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}]}),
    ("/v1/requests", {"model": "tiny", "prompt": "w1 w2"}),
]
REFUSED = [
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [3, 10**30]}, "stop_token_ids"),
    ({"stop_token_ids": [-2]}, "stop_token_ids"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # over the model's default max_tokens (16)
]


@pytest.mark.parametrize(("url", "body"), ROUTES)
@pytest.mark.parametrize(("extra", "field"), REFUSED)
async def test_values_the_engine_refuses_are_a_400_naming_the_field(
        api: httpx.AsyncClient, redis: Redis, url: str, body: dict, extra: dict, field: str) -> None:
    r = await api.post(url, json={**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field), r.text
    assert await redis.xlen(ModelKeys("tiny").requests) == 0


@pytest.mark.parametrize(("url", "body"), ROUTES)
@pytest.mark.parametrize("extra", [{"top_k": 50, "stop_token_ids": [0, VOCAB - 1], "min_tokens": 16},
                                   {"top_k": -1, "min_tokens": 8, "max_tokens": 8}, {"top_k": 2**31 - 1}])
async def test_values_in_bounds_are_queued(api: httpx.AsyncClient, redis: Redis, url: str, body: dict,
                                           extra: dict) -> None:
    r = await api.post(url, json={**body, **extra})
    assert r.status_code in (202, 504), r.text  # queued (no worker runs)
    assert await redis.xlen(ModelKeys("tiny").requests) == 1


async def test_tokenize_refuses_a_prompt_over_the_limit_before_tokenizing(
        api: httpx.AsyncClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    r = await api.post("/tokenize", json={"model": "tiny", "prompt": "w1 " * 10})
    assert r.status_code == 200 and r.json()["count"] == 10, r.text
    monkeypatch.setattr(app.state.sluice.intake.prompt_limits, "loaded", lambda _: pytest.fail("tokenizer used"))
    r = await api.post("/tokenize", json={"model": "tiny", "prompt": "w" * (PROMPT_LIMIT + 1)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text
    r = await api.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "w" * 600},
                                                                        {"role": "user", "content": "w" * 401}]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages", r.text


async def test_tokenizers_are_read_at_startup_and_a_later_model_s_off_the_event_loop(
        app: FastAPI, api: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = app.state.sluice
    limits = s.intake.prompt_limits
    tiny = (await s.deployments.all(fresh=True))["tiny"]
    assert limits.is_loaded(tiny)  # read before the api took a request: none has come yet
    later = tiny.model_copy(update={"name": "later", "path": str(tiny_model(tmp_path / "later"))})
    await s.deployments.deploy(later)
    assert not limits.is_loaded(later)
    first_reads, read = [], limits._load

    def recorded(model: object) -> object:
        if not limits.is_loaded(model):  # type: ignore[arg-type]
            first_reads.append(threading.current_thread() is threading.main_thread())
        return read(model)  # type: ignore[arg-type]

    monkeypatch.setattr(limits, "_load", recorded)
    r = await api.post("/v1/completions", json={"model": "later", "prompt": "w1", "stop_token_ids": [VOCAB]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text  # its vocabulary: read
    assert first_reads == [False] and limits.is_loaded(later)
