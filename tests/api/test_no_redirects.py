"""No trailing-slash redirect (issue 29, finding 14): Starlette's redirect built its Location
from the Host header, so a link to the api with a forged Host sent the client elsewhere. A
path with or without a stray slash is answered where it is, never redirected."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from tests.api.conftest import http_client


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "test"])
async def test_a_trailing_slash_is_not_redirected_to_the_host_header(app: FastAPI, host: str) -> None:
    paths = {r.path.replace("{", "").replace("}", "") for r in app.routes if isinstance(r, APIRoute)}
    async with http_client(app) as client:
        for path in sorted(paths):
            for other in (path + "/", path.rstrip("/") + "//"):
                r = await client.get(other, headers={"host": host}, follow_redirects=False)
                assert not r.is_redirect and "location" not in r.headers, (other, r.status_code, r.headers)
                assert host not in r.text


async def test_the_paths_themselves_still_answer(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).status_code == 200
    assert (await api.get("/healthz/")).status_code == 404
