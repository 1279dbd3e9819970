"""No input reaches a 500: hostile bodies on every JSON route and on /infer get a 4xx naming the
problem, an unexpected exception becomes a logged 500 with a request id, and the OpenAPI document
declares what the fuzz needs to reach all of it. The api runs in-process on a real Redis."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
import pyarrow as pa
import pytest

from tests.api.arrow_bodies import ARROW, bomb, ipc
from tests.api.conftest import StartApi, http_client

# `ctx` has a context limit; `hub` has neither a limit nor a tokenizer the api can read, so only the
# api's own bound stands between a huge max_tokens and the queue.
MODELS_YAML = """
models:
  - name: ctx
    framework_config: {max_model_len: 2048}
    dynamic_batching_config: {max_batch_delay_ms: 5, batch_size_target: 4, batch_size_limit: 8}
  - name: hub
    path: example/not-downloaded
    continuous_batching_config: {max_concurrent_batch_size: 4}
"""


async def _boom() -> None:
    raise RuntimeError("a bug")


@pytest.fixture
async def api(start_api: StartApi) -> AsyncIterator[httpx.AsyncClient]:
    # No worker runs: a body that wrongly passes waits `max_wait_s` and gets a 504, not a 4xx.
    async with start_api(MODELS_YAML, max_wait_s=0.5) as app:
        app.add_api_route("/boom", _boom)
        async with http_client(app) as client:
            yield client


def post_json(api: httpx.AsyncClient, url: str, raw: bytes) -> object:
    return api.post(url, content=raw, headers={"content-type": "application/json"})


async def assert_4xx(response: httpx.Response, status: int, naming: str) -> None:
    assert response.status_code == status, response.text
    assert naming in response.json()["error"]["message"], response.text


@pytest.mark.parametrize(("raw", "status", "naming"), [
    (b'[{"prompt": "p", "max_tokens": 100000000000000000000000}]', 422, "max_tokens"),  # was OverflowError
    (b'[{"prompt": "a\\ud800"}]', 422, "prompt"),  # was UnicodeEncodeError
    (b"[" * 100_000 + b"]" * 100_000, 400, "JSON"),  # was RecursionError
    (b'[{"prompt": "p", "max_tokens": 1.5}]', 422, "max_tokens"),  # was silently 1
])
async def test_hostile_json_rows_on_infer(api: httpx.AsyncClient, raw: bytes, status: int, naming: str) -> None:
    await assert_4xx(await post_json(api, "/v1/models/ctx/infer", raw), status, naming)


async def test_hostile_arrow_on_infer(api: httpx.AsyncClient) -> None:
    null_prompt = ipc(pa.table({"prompt": pa.array([None], pa.string())}))  # was ValueError from the cast
    r = await api.post("/v1/models/ctx/infer", content=null_prompt, headers={"content-type": ARROW})
    await assert_4xx(r, 400, "prompt")
    floats = ipc(pa.table({"prompt": ["p"], "max_tokens": [2.0]}))
    r = await api.post("/v1/models/ctx/infer", content=floats, headers={"content-type": ARROW})
    await assert_4xx(r, 422, "max_tokens")
    r = await api.post("/v1/models/ctx/infer", content=bomb(200 * 1024 * 1024, "zstd"), headers={"content-type": ARROW})
    await assert_4xx(r, 413, "SLUICE_MAX_DECODED_BYTES")


@pytest.mark.parametrize(("url", "raw", "naming"), [
    ("/v1/completions", b'{"model": "ctx", "prompt": "a\\ud800"}', "prompt"),
    ("/v1/completions", b'{"model": "ctx", "prompt": ["ok", "a\\ud800"]}', "prompt"),
    ("/v1/completions", b'{"model": "ctx", "prompt": "p", "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions", b'{"model": "ctx", "messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages"),
    ("/v1/chat/completions",
     b'{"model": "ctx", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages"),
    ("/v1/requests", b'{"model": "ctx", "prompt": "p", "stop": ["\\ud800"]}', "stop"),
    ("/v1/requests", b'{"model": "ctx", "prompt": "p", "\\ud800": 1}', "unicode"),
    ("/v1/completions", b'{"model": "hub", "prompt": "p", "max_tokens": 100000000000000000000000}', "max_tokens"),
    ("/v1/chat/completions",
     b'{"model": "hub", "messages": [{"role": "user", "content": "p"}], "max_completion_tokens": 10000000000000}',
     "max_tokens"),
    ("/v1/chat/completions",
     b'{"model": "hub", "messages": [{"role": "user", "content": "p"}], "max_tokens": 100000000000000000000000}',
     "max_tokens"),
])
async def test_hostile_values_on_the_json_routes(api: httpx.AsyncClient, url: str, raw: bytes, naming: str) -> None:
    r = await post_json(api, url, raw)
    assert r.status_code == 422, r.text
    assert naming in r.json()["error"]["message"], r.text


async def test_deep_json_on_the_json_routes(api: httpx.AsyncClient) -> None:
    for url in ("/v1/requests", "/v1/completions", "/v1/chat/completions"):
        r = await post_json(api, url, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert 400 <= r.status_code < 500, (url, r.text)


async def test_an_unexpected_exception_is_a_logged_500_with_a_request_id(
        api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="sluice.api.errors"):
        r = await api.get("/boom")
    assert r.status_code == 500
    error = r.json()["error"]
    rid = error["request_id"]
    assert error["type"] == "internal_error" and rid in error["message"] and r.headers["x-request-id"] == rid
    (record,) = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert record.exc_info and "a bug" in str(record.exc_info[1])

    r = await api.get("/boom", headers={"X-Request-ID": "lb-42"})  # a proxy's id is kept
    assert r.json()["error"]["request_id"] == "lb-42"
    r = await api.get("/boom", headers={"X-Request-ID": "forged\\nline"})
    assert r.json()["error"]["request_id"].startswith("err-")


async def test_the_openapi_document_declares_bodies_headers_and_auth(api: httpx.AsyncClient) -> None:
    spec = (await api.get("/openapi.json")).json()
    infer = spec["paths"]["/v1/models/{model}/infer"]["post"]
    assert set(infer["requestBody"]["content"]) == {"application/json", ARROW}
    assert infer["requestBody"]["content"]["application/json"]["schema"]["type"] == "array"
    submit = spec["paths"]["/v1/requests"]["post"]
    assert any(p["in"] == "header" and p["name"].lower() == "idempotency-key" for p in submit["parameters"])
    schemes = spec["components"]["securitySchemes"]
    assert [s["scheme"].lower() for s in schemes.values()] == ["bearer"]
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            if path.startswith("/v1/") and "health" not in op["tags"]:  # /v1/workers is the health router's
                assert op.get("security"), f"{method.upper()} {path} does not declare its API key"


async def test_errors_stay_json_when_they_quote_unencodable_input(api: httpx.AsyncClient) -> None:
    r = await post_json(api, "/v1/models/ctx/infer", b'[{"prompt": "p", "\\ud800": 1}]')
    assert r.status_code == 400 and json.loads(r.content)["error"]["message"].startswith("rows[0]: unknown")


@pytest.mark.parametrize("config", [
    {"dynamic_batching_config": {"batch_size_target": 10**23}},
    {"continuous_batching_config": {"max_concurrent_batch_size": 10**23}},
])
async def test_a_reconfiguration_cannot_break_the_worker_s_reads(api: httpx.AsyncClient, config: dict) -> None:
    # Accepted before, and every XREADGROUP of the model's worker failed: COUNT out of range.
    r = await api.put("/v1/models/ctx/config", json=config)
    assert r.status_code == 422 and "at most" in r.json()["error"]["message"], r.text
