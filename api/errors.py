"""Error answers: a clear message naming the problem, in one shape for every route."""

from __future__ import annotations

import json
import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.api.limits import StartedSend

log = logging.getLogger(__name__)

# A caller's own X-Request-ID is reused in the logs only when it cannot forge log lines.
_CALLER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


class ErrorResponse(JSONResponse):
    """Escaped to ASCII: a message may quote the caller's input, and a lone surrogate in it
    (JSON allows "\\ud800") cannot be encoded as UTF-8."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


def error_body(message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": code, "param": param, "code": code}}


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _request_id(scope: Scope) -> str:
    given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
    return given if _CALLER_ID.fullmatch(given) else f"err-{uuid.uuid4().hex}"


class UnexpectedErrors:
    """Plain ASGI, outermost: an exception no handler answered becomes a 500 in the api's error
    shape instead of a bare text page, and the same request id goes into the answer and the
    logged traceback, so that a user's report leads to the traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = StartedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception:
            rid = _request_id(scope)
            log.exception("unexpected error, request id %s: %s %r", rid, scope.get("method"),
                          scope.get("path"))
            if tracked.started:  # a streamed answer is under way: only the server can end the connection
                raise
            body = error_body(f"internal error; quote request id {rid} when reporting it", "internal_error")
            body["error"]["request_id"] = rid
            await ErrorResponse(body, 500, headers={"X-Request-ID": rid})(scope, receive, send)


def install(app: FastAPI) -> None:
    """The error handlers, and the catch-all for everything they do not answer (added last: outermost)."""
    app.add_middleware(UnexpectedErrors)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> ErrorResponse:
        return ErrorResponse(error_body(exc.message, exc.code, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_away(_: Request, exc: Exception) -> ErrorResponse:
        # Redis down, or every connection of this process's bounded pool busy past its wait:
        # a retry later can succeed, so a 503 that says so (never a 500).
        log.warning("Redis unavailable: %s: %s", type(exc).__name__, exc)
        message = f"Redis is unavailable or saturated ({type(exc).__name__}: {exc}); retry"
        return ErrorResponse(error_body(message, "unavailable"), 503, headers={"Retry-After": "1"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> ErrorResponse:
        errors = exc.errors()
        parts = [f"{_field(e['loc'])}: {e['msg']}" for e in errors]
        param = _field(errors[0]["loc"]) if errors else None
        body = error_body("; ".join(parts) or "invalid request", "invalid_request_error", param)
        body["detail"] = [{k: e[k] for k in ("loc", "msg", "type")} for e in errors]
        return ErrorResponse(body, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> ErrorResponse:
        code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code, "invalid_request_error")
        return ErrorResponse(error_body(str(exc.detail), code), exc.status_code, headers=exc.headers)
