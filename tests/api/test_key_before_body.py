"""The key is checked before any body is read (issue 29, finding 3): FastAPI reads and parses a
body, a multipart upload spooled to disk included, before a route's dependencies run, so a
request without a valid key could make the api read and store up to the body limit. Every route
that needs a key now answers 401 without reading a byte of the body; through a real server, an
upload without a key gets its 401 from its headers alone, nothing is spooled, and the rest of
the body is never read."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.types import Message

from sluice.api.auth import _needs_key
from sluice.api.connections import guarded
from sluice.config.settings import Settings
from tests.api.keyed_app import ALICE, client, keyed_app
from tests.api.test_slow_clients import serving

WITHOUT = [None, "Bearer wrong-key", "Basic YWxpY2U6eA==", "Bearer ", "bearer"]


@pytest.fixture
async def app(settings: Settings, tmp_path: Path) -> AsyncIterator[FastAPI]:
    async with keyed_app(settings, tmp_path) as built:
        yield built


def keyed_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, a path that matches) of every route that needs a key."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute) and _needs_key(route.dependant):
            path = route.path_format.replace("{", "").replace("}", "")  # any value for a path parameter
            out += [(method, path) for method in sorted(route.methods)]
    return out


async def answer_without_body(app: FastAPI, method: str, path: str, authorization: str | None) -> tuple[int, bool]:
    """The status `app` answers a request whose body never comes, and whether it asked for the body."""
    read: list[bool] = []
    sent: list[Message] = []

    async def receive() -> Message:
        read.append(True)
        await asyncio.Event().wait()  # a client that never sends its body
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-type", b"multipart/form-data; boundary=x"), (b"content-length", b"1000000")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("test", 80)}
    try:
        await asyncio.wait_for(app(scope, receive, send), 10)
    except TimeoutError:
        return 0, bool(read)  # it waited for the body
    return sent[0]["status"], bool(read)


async def test_every_route_that_needs_a_key_answers_401_without_reading_the_body(app: FastAPI) -> None:
    routes = keyed_routes(app)
    assert len(routes) > 25 and ("POST", "/v1/files") in routes and ("POST", "/v1/completions") in routes
    for method, path in routes:
        for authorization in WITHOUT:
            answered = await answer_without_body(app, method, path, authorization)
            assert answered == (401, False), (method, path, authorization, answered)


async def test_routes_without_a_key_and_good_keys_still_work(app: FastAPI) -> None:
    async with client(app, None) as anonymous, client(app, ALICE) as alice:
        assert (await anonymous.get("/healthz")).status_code == 200
        assert (await anonymous.get("/dashboard")).status_code == 200
        assert (await anonymous.get("/no/such/route")).status_code == 404
        assert (await alice.get("/v1/models")).status_code == 200
        r = await alice.post("/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"})
        assert r.status_code in (200, 400), r.text  # reached the route (the line itself may be refused)
        assert (await alice.get("/v1/dashboard")).status_code == 403  # a user key: forbidden, not unknown


async def test_an_upload_without_a_key_is_refused_from_its_headers_and_never_read(
        app: FastAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where an upload would be spooled
    base = guarded(app.state.sluice.settings)
    received: list[int] = []

    class Counted(base):  # type: ignore[valid-type, misc]
        def data_received(self, data: bytes) -> None:
            received.append(len(data))
            super().data_received(data)

    size = 150 * 1024 * 1024
    head = (b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; boundary=b\r\n"
            b"content-length: %d\r\n\r\n" % size)
    async with serving(app, app.state.sluice.settings, protocol=Counted) as address:
        reader, writer = await asyncio.open_connection(*address)
        writer.write(head)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # before a byte of the body
        assert answer.startswith(b"HTTP/1.1 401"), answer
        closed = False
        try:
            for _ in range(64):  # up to 4 MB more: the server has closed, so this soon fails
                writer.write(b"--b\r\n" + b"x" * 65536)
                await asyncio.wait_for(writer.drain(), 10)
            await asyncio.wait_for(reader.read(), 10)  # the server's end of the connection
            closed = True
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        writer.close()
        assert closed
    assert sum(received) <= 64 * 1024, received
    assert list(spool.iterdir()) == []
