"""A plain ASGI middleware refusing request bodies over the configured size with 413,
before they are read into memory (by Content-Length, or while a chunked body streams in)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised at the app's `receive` once a body passes its limit. An HTTPException, because
    FastAPI turns any other exception met while it reads a body into a 400 "error parsing the
    body": this one it raises again, and the app's handler answers it 413 (api/errors.py)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, message(limit))


def message(limit: int) -> str:
    return f"body: larger than {limit} bytes"


class StartedSend:
    """A `send` that remembers whether the response has started: past that, an error can no
    longer be answered, only raised."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, overrides: dict[str, int] | None = None):
        """`overrides`: other limits for exact paths (file uploads)."""
        self.app = app
        self.max_bytes = max_bytes
        self.overrides = overrides or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.overrides.get(scope["path"], self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._refuse(send, limit)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        tracked = StartedSend(send)
        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            if not tracked.started:
                await self._refuse(send, limit)

    async def _refuse(self, send: Send, limit: int) -> None:
        body = json.dumps({"error": {
            "message": message(limit), "type": "invalid_request_error",
            "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
