"""Error answers in one shape: ApiError, validation errors naming the field, Starlette's own
errors, and an unexpected exception as a logged 500 whose request id leads to the traceback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sluice.api.errors import ApiError, ErrorResponse, UnexpectedErrors, error_body, install


class Body(BaseModel):
    count: int


def build() -> FastAPI:
    app = FastAPI()
    install(app)

    @app.get("/refused")
    async def refused() -> None:
        raise ApiError(409, "it is taken", code="conflict", param="name", headers={"Retry-After": "3"})

    @app.post("/body")
    async def body(b: Body, n: int = Query(ge=0)) -> dict:
        return {"count": b.count, "n": n}

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    @app.get("/stream-bug")
    async def stream_bug() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first"
            raise RuntimeError("mid-stream")

        return StreamingResponse(chunks())

    return app


@pytest.fixture
async def api() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def test_an_api_error_keeps_its_status_code_param_and_headers(api: httpx.AsyncClient) -> None:
    r = await api.get("/refused")
    assert r.status_code == 409 and r.headers["Retry-After"] == "3"
    assert r.json() == {"error": {"message": "it is taken", "type": "conflict", "param": "name", "code": "conflict"}}


async def test_a_validation_error_names_each_field(api: httpx.AsyncClient) -> None:
    r = await api.post("/body", params={"n": -1}, json={"count": "many"})
    assert r.status_code == 422
    error = r.json()["error"]
    assert "count:" in error["message"] and "n:" in error["message"]
    assert error["param"] in ("count", "n") and error["type"] == "invalid_request_error"
    assert {tuple(d["loc"]) for d in r.json()["detail"]} == {("body", "count"), ("query", "n")}
    r = await api.post("/body", params={"n": 1}, content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["message"]


async def test_starlette_errors_take_the_same_shape(api: httpx.AsyncClient) -> None:
    r = await api.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = await api.delete("/refused")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


async def test_an_unexpected_exception_is_a_500_with_a_request_id_in_answer_and_log(
        api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="sluice.api.errors"):
        r = await api.get("/bug")
    assert r.status_code == 500
    rid = r.json()["error"]["request_id"]
    assert r.headers["X-Request-ID"] == rid and rid in r.json()["error"]["message"]
    assert "a bug" not in r.text  # the traceback is for the log, not the caller
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


async def test_a_callers_request_id_is_reused_only_when_it_cannot_forge_log_lines(api: httpx.AsyncClient) -> None:
    r = await api.get("/bug", headers={"X-Request-ID": "client-42:a.b"})
    assert r.json()["error"]["request_id"] == "client-42:a.b"
    for forged in (b"x\ty", b"a" * 129, b"id with spaces", "é".encode()):
        r = await api.get("/bug", headers=[(b"X-Request-ID", forged)])
        assert r.json()["error"]["request_id"].startswith("err-"), forged


async def test_an_error_after_the_answer_started_is_raised_not_answered_twice() -> None:
    transport = httpx.ASGITransport(app=build(), raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        with pytest.raises(RuntimeError, match="mid-stream"):
            await client.get("/stream-bug")


async def test_unexpected_errors_pass_other_scopes_through() -> None:
    seen: list[str] = []

    async def inner(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        seen.append(scope["type"])

    await UnexpectedErrors(inner)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]


def test_an_error_quoting_a_lone_surrogate_still_renders() -> None:
    body = ErrorResponse(error_body("prompt: '\ud800' is not valid", "invalid_request_error"), 422).body
    assert b"\\ud800" in body
    body.decode("ascii")  # escaped: never a UnicodeEncodeError on the way out
