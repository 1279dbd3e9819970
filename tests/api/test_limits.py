"""BodySizeLimit as plain ASGI: a body over the limit is a 413 naming the limit, by Content-Length
before anything is read, or while a chunked body streams in; other scopes pass through."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from sluice.api.limits import BodySizeLimit, StartedSend

LIMIT = 100


class Echo:
    """Reads the whole body and answers its length; counts the calls that reached it."""

    def __init__(self, start_first: bool = False) -> None:
        self.calls = 0
        self.start_first = start_first
        self.scopes: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        self.scopes.append(scope["type"])
        if scope["type"] != "http":
            return
        if self.start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        if not self.start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})


def client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")  # type: ignore[arg-type]


async def chunks(n: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield b"x" * size


async def test_within_the_limit_the_body_reaches_the_app() -> None:
    inner = Echo()
    async with client(BodySizeLimit(inner, LIMIT)) as c:
        r = await c.post("/", content=b"x" * LIMIT)
    assert r.status_code == 200 and r.text == str(LIMIT)


async def test_an_announced_body_over_the_limit_is_refused_before_the_app_runs() -> None:
    inner = Echo()
    async with client(BodySizeLimit(inner, LIMIT)) as c:
        r = await c.post("/", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413
    assert r.json()["error"]["message"] == f"body: larger than {LIMIT} bytes"
    assert r.json()["error"]["code"] == "request_too_large"
    assert inner.calls == 0


@pytest.mark.parametrize("length", ["abc", "-5", ""])
async def test_a_streamed_or_mislabelled_body_is_counted_as_it_comes(length: str) -> None:
    inner = Echo()
    async with client(BodySizeLimit(inner, LIMIT)) as c:
        r = await c.post("/", content=chunks(5, 30))  # chunked: no Content-Length
        assert r.status_code == 413, r.text
        headers = {"content-length": length} if length else {}
        r = await c.post("/", content=chunks(2, 30), headers=headers)
    assert r.status_code == 200 and r.text == "60"


async def test_overrides_set_other_limits_for_exact_paths() -> None:
    async with client(BodySizeLimit(Echo(), LIMIT, overrides={"/v1/files": 10 * LIMIT})) as c:
        assert (await c.post("/v1/files", content=b"x" * (5 * LIMIT))).status_code == 200
        assert (await c.post("/v1/files/x", content=b"x" * (5 * LIMIT))).status_code == 413


async def test_once_the_answer_started_nothing_second_is_sent() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    body = iter([{"type": "http.request", "body": b"x" * (LIMIT + 1), "more_body": False}])

    async def receive() -> dict:
        return next(body)

    scope = {"type": "http", "path": "/", "headers": []}
    await BodySizeLimit(Echo(start_first=True), LIMIT)(scope, receive, send)  # type: ignore[arg-type]
    assert [m["type"] for m in sent] == ["http.response.start"]  # no 413 after a 200 had started


async def test_other_scopes_pass_through() -> None:
    inner = Echo()
    await BodySizeLimit(inner, LIMIT)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert inner.scopes == ["lifespan"]


async def test_started_send_remembers_the_start() -> None:
    seen: list[dict] = []

    async def send(message: dict) -> None:
        seen.append(message)

    tracked = StartedSend(send)  # type: ignore[arg-type]
    assert not tracked.started
    await tracked({"type": "http.response.start", "status": 200})
    await tracked({"type": "http.response.body", "body": b""})
    assert tracked.started and len(seen) == 2
