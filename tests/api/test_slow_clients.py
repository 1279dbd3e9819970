"""Slow clients cannot hold the api's connections (issue 29, finding 2): through a real uvicorn
server with the api's protocol (api/connections.py) and raw sockets, partial headers, headers a
byte at a time and a trickled body are closed after their timeouts (1 s here), and connections
beyond the cap are refused with 503 before anything of them is read, while /healthz answers."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from sluice.api.connections import GuardedHttp, _environment_limits, guarded
from sluice.cli.main import app as cli
from sluice.config.settings import Settings
from tests.api.conftest import StartApi

TIMEOUT_S = 1.0
CLOSED_WITHIN_S = 15.0  # generous: the machine may be loaded
MAX_CONNECTIONS = 8
Address = tuple[str, int]


@asynccontextmanager
async def serving(app: FastAPI, settings: Settings, protocol: type | None = None) -> AsyncIterator[Address]:
    """`app` (its lifespan already run) behind uvicorn with the api's protocol (or `protocol`),
    on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=protocol or guarded(settings), lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def server(start_api: StartApi) -> AsyncIterator[Address]:
    limits = {"api_header_timeout_s": TIMEOUT_S, "api_body_timeout_s": TIMEOUT_S, "api_body_min_rate": 1024,
              "api_max_connections": MAX_CONNECTIONS}
    async with start_api(**limits) as app, serving(app, app.state.sluice.settings) as address:
        yield address


async def closed_while(address: Address, feed: Callable[[asyncio.StreamWriter], object]) -> tuple[bytes, float]:
    """Connect, run `feed` (which writes slowly, for far longer than the timeouts) beside a
    reader, and return what the server answered and when it closed the connection (seconds)."""
    reader, writer = await asyncio.open_connection(*address)
    start = time.monotonic()
    feeding = asyncio.create_task(feed(writer))  # type: ignore[arg-type]
    answer = b""
    try:
        async with asyncio.timeout(CLOSED_WITHIN_S):
            while chunk := await reader.read(65536):
                answer += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        feeding.cancel()
        writer.close()
    return answer, time.monotonic() - start


async def trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    for i in range(len(data)):
        writer.write(data[i:i + 1])
        await writer.drain()
        await asyncio.sleep(every_s)


async def healthz(address: Address) -> bytes:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    try:
        return await reader.read()
    finally:
        writer.close()


async def test_partial_headers_are_closed_after_the_header_timeout(server: Address) -> None:
    async def partial(writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # never the blank line
        await asyncio.sleep(3600)

    answer, _ = await closed_while(server, partial)
    assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_a_connection_that_sends_nothing_is_closed(server: Address) -> None:
    answer, _ = await closed_while(server, lambda w: asyncio.sleep(3600))
    assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_headers_a_byte_at_a_time_are_closed_although_they_progress(server: Address) -> None:
    headers = b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 4000 + b"\r\n\r\n"
    answer, _ = await closed_while(server, lambda w: trickle(w, headers, 0.05))  # 200 s to send it all
    assert answer.startswith(b"HTTP/1.1 408"), answer


@pytest.mark.parametrize("every_s", [0.05, 3600])
async def test_a_trickled_or_stalled_body_is_closed(server: Address, every_s: float) -> None:
    body = b'{"model": "m", "prompt": "' + b"a" * 100_000 + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))

    async def slow(writer: asyncio.StreamWriter) -> None:
        writer.write(head + body[:10])
        await trickle(writer, body[10:], every_s)  # 20 B/s: over an hour for all of it

    answer, _ = await closed_while(server, slow)
    assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_a_body_at_a_fair_rate_is_not_cut(server: Address) -> None:
    """A body that keeps the minimum rate is read to its end: 6 KB at about 10 KB/s takes
    longer than the 1 s timeout, and gets its answer."""
    body = b'{"model": "nope", "prompt": "' + b"a" * 6000 + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body))

    async def fair(writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        for i in range(0, len(body), 1024):  # each piece buys a second; sent every 0.1 s
            writer.write(body[i:i + 1024])
            await writer.drain()
            await asyncio.sleep(0.1)

    answer, _ = await closed_while(server, fair)
    assert answer.startswith(b"HTTP/1.1 404"), answer  # model "nope": the body was read and parsed


@pytest.fixture
async def patient_server(start_api: StartApi) -> AsyncIterator[Address]:
    """Timeouts far longer than the test: a connection closes only by its client or the cap."""
    limits = {"api_header_timeout_s": 120.0, "api_body_timeout_s": 120.0, "api_body_min_rate": 1024,
              "api_max_connections": MAX_CONNECTIONS}
    async with start_api(**limits) as app, serving(app, app.state.sluice.settings) as address:
        yield address


async def being_served(address: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection past its headers, its body awaited: the server's 100 Continue says it read them."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"POST /v1/requests HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 10\r\nexpect: 100-continue\r\n\r\n")
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLOSED_WITHIN_S)
    assert answer.startswith(b"HTTP/1.1 100"), answer
    return reader, writer


async def test_connections_beyond_the_cap_are_refused_while_every_one_is_served(patient_server: Address) -> None:
    busy = [await being_served(patient_server) for _ in range(MAX_CONNECTIONS)]
    try:
        refused = await asyncio.wait_for(asyncio.open_connection(*patient_server), CLOSED_WITHIN_S)
        answer = await asyncio.wait_for(refused[0].read(), CLOSED_WITHIN_S)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        refused[1].close()
        for reader, _ in busy:  # none of them was closed for it
            assert not reader.at_eof()
    finally:
        for _, writer in busy:
            writer.close()
    # the busy ones are gone: the server answers again
    async with asyncio.timeout(CLOSED_WITHIN_S):
        while not (answer := await healthz(patient_server)).startswith(b"HTTP/1.1 200"):
            await asyncio.sleep(0.05)


async def test_at_the_cap_a_new_connection_takes_the_place_of_the_one_waiting_longest(patient_server: Address) -> None:
    """Slow or silent connections (a slowloris) cannot lock out a client that sends its request
    at once, such as a health probe: the one that has waited longest for its headers makes room."""
    silent = [await asyncio.open_connection(*patient_server) for _ in range(MAX_CONNECTIONS)]
    try:
        for oldest in range(3):  # at the cap each time: the probe's own connection closes after its answer
            assert (await asyncio.wait_for(healthz(patient_server), CLOSED_WITHIN_S)).startswith(b"HTTP/1.1 200")
            # the oldest made room (the header timeout is far off: only the cap closed it)
            answer = await asyncio.wait_for(silent[oldest][0].read(), CLOSED_WITHIN_S)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            silent.append(await asyncio.open_connection(*patient_server))  # back to the cap
    finally:
        for _, writer in silent:
            writer.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_sluice_api_serves_with_these_limits(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    monkeypatch.setenv("SLUICE_API_HEADER_TIMEOUT_S", "7")
    monkeypatch.setenv("SLUICE_API_MAX_CONNECTIONS", "100")
    monkeypatch.delenv("SLUICE_API_KEYS", raising=False)
    served: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda *_a, **kw: served.update(kw))
    done = CliRunner().invoke(cli, ["api", "--port", "0", "--workers", str(workers)])
    assert done.exit_code == 0, done.output
    protocol = served["http"]
    if workers > 1:  # each process imports it and reads SLUICE_* itself
        assert protocol == "sluice.api.connections:FromEnvironment"
        _environment_limits.cache_clear()
        limits = _environment_limits()
        assert limits[0] == 7 and limits[3] == 100
    else:
        assert issubclass(protocol, GuardedHttp)  # type: ignore[arg-type]
        assert protocol.header_timeout_s == 7 and protocol.max_connections == 100  # type: ignore[union-attr]
