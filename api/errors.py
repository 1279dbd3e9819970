"""Error answers: a clear message naming the problem, in one shape for every route."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


def error_body(message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": code, "param": param, "code": code}}


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.code, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = [f"{_field(e['loc'])}: {e['msg']}" for e in errors]
        param = _field(errors[0]["loc"]) if errors else None
        body = error_body("; ".join(parts) or "invalid request", "invalid_request_error", param)
        body["detail"] = [{k: e[k] for k in ("loc", "msg", "type")} for e in errors]
        return JSONResponse(body, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), code), exc.status_code, headers=exc.headers)
