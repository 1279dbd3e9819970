"""The floor of a Python api's CPU per streamed token: an ASGI server with nothing behind it
(no Redis, no queue, no middleware) that streams S server-sent-event streams of one token every
T ms, stepped as `sluice bench tokens`'s null engine steps (one timer per step wakes every
stream), to the same client on plain sockets. It prints the server's CPU per 1,000 tokens, for a
bare ASGI app and for a FastAPI route that answers with Sluice's own SSE response (api/sse.py's
EventStream, on sse_starlette, its events pre-encoded as Sluice's are), each on uvicorn with
uvloop and httptools as `sluice api` runs.

What `sluice bench tokens` reports for Sluice's api at the same streams and interval, less this
floor, is what the queue's read path costs; the floor itself is what any Python api pays to
write one event per token per stream.

    .venv/bin/python scripts/sse_floor.py [--streams 64] [--token-ms 5] [--max-tokens 200] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from sluice.bench.frontend_cpu import cpu_s
from sluice.supervisor.processes import free_port

_STEPS: dict[int, asyncio.Future[None]] = {}


async def _step(k: int, interval_s: float) -> None:
    """Wait for step `k` of a grid of `interval_s` from time 0 of the loop: one timer per step."""
    loop = asyncio.get_running_loop()
    at = k * interval_s
    if loop.time() >= at:
        return
    fut = _STEPS.get(k)
    if fut is None:
        fut = _STEPS[k] = loop.create_future()
        loop.call_at(at, lambda: _STEPS.pop(k).set_result(None))
    await fut


def _events(n: int, ms: float):
    async def gen():
        interval = ms / 1000
        k = int(asyncio.get_running_loop().time() / interval) + 1
        for i in range(n):
            await _step(k + i, interval)
            yield f'{{"index": {i}, "text": {json.dumps(f" t{i}")}, "row": 0}}'
    return gen()


async def bare(scope, receive, send) -> None:  # noqa: ANN001 - ASGI
    q = dict(p.split("=") for p in scope["query_string"].decode().split("&"))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    async for data in _events(int(q["n"]), float(q["ms"])):
        await send({"type": "http.response.body", "body": f"event: delta\r\ndata: {data}\r\n\r\n".encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"event: done\r\ndata: {}\r\n\r\n", "more_body": False})


def fastapi_app():
    from fastapi import FastAPI

    from sluice.api.sse import EventStream, chunk, sse

    app = FastAPI()

    @app.get("/")
    async def stream(n: int, ms: float) -> EventStream:
        async def events():
            async for data in _events(n, ms):
                yield chunk([sse(data, "delta")])
            yield chunk([sse("{}", "done")])
        return EventStream(events(), ping=15)

    return app


async def _one(port: int, n: int, ms: float) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /?n={n}&ms={ms} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    body = bytearray()
    while b"event: done" not in body[-64:]:
        got = await reader.read(65536)
        if not got:
            break
        body += got
    writer.close()
    return body.count(b"event: delta")


async def _load(port: int, streams: int, n: int, ms: float, seconds: float) -> int:
    stop, total = time.monotonic() + seconds, 0

    async def client(k: int) -> None:
        nonlocal total
        await asyncio.sleep(n * ms / 1000 * k / streams)  # spread out, as bench tokens' clients
        while time.monotonic() < stop:
            got = await _one(port, n, ms)  # (`total += await ...` would read total before the await)
            total += got

    await asyncio.gather(*(client(k) for k in range(streams)))
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    # (the server's own process: bare or fastapi, port)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.serve:
        import uvicorn
        app, port = a.serve.split(":")
        uvicorn.run(bare if app == "bare" else fastapi_app(), port=int(port), loop="uvloop", http="httptools",
                    log_level="warning")
        return
    for app in ("bare", "fastapi"):
        port = free_port()
        server = subprocess.Popen([sys.executable, __file__, "--serve", f"{app}:{port}"])
        try:
            time.sleep(3)
            asyncio.run(_load(port, 2, 8, 1.0, 1.0))  # warm up
            before = cpu_s(server.pid)
            tokens = asyncio.run(_load(port, a.streams, a.max_tokens, a.token_ms, a.seconds))
            used = cpu_s(server.pid) - before
        finally:
            server.terminate()
            server.wait()
        print(f"{app:8s} {a.streams} x {a.token_ms:g} ms: {tokens} tokens, "
              f"server CPU {used * 1e6 / tokens:.1f} ms per 1,000 tokens")


if __name__ == "__main__":
    main()
