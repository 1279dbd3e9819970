"""Structured outputs cost the event loop nothing (issue 29, finding 12): xgrammar, whose first
import stalled the loop 1.6 s inside a request, is imported in a thread when the api starts
(finished before it answers), and each constraint is compiled in a worker thread, not on the
loop."""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from sluice.protocol import structured
from tests.api.conftest import StartApi
from tests.broker.helpers import MODEL


async def test_the_backend_is_imported_when_the_api_starts(start_api: StartApi) -> None:
    """In a thread, and finished before the api answers anything: no import runs beside requests."""
    structured.backend.cache_clear()
    async with start_api() as app:
        assert app.state.structured_backend.done()
        assert structured.backend.cache_info().currsize == 1


def schema() -> dict:
    """A schema no earlier request compiled (each is compiled once per process)."""
    return {"type": "object", "properties": {f"p{uuid.uuid4().hex}": {"type": "string"}}}


@pytest.fixture
async def app(start_api: StartApi) -> AsyncIterator[FastAPI]:  # conftest's `api` client talks to it
    async with start_api(max_wait_s=0.05) as built:  # no worker runs: an admitted call ends 504 at once
        yield built


FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}


@pytest.mark.parametrize(("url", "body"), [
    ("/v1/completions", {"model": MODEL, "prompt": "p", "max_tokens": 2, "response_format": FORMAT}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "p"}], "max_tokens": 2,
                              "response_format": FORMAT}),
    ("/v1/responses", {"model": MODEL, "input": "p", "max_output_tokens": 2, "background": True,
                       "text": {"format": {"type": "json_schema", "name": "x", "schema": None}}}),
])
async def test_a_constraint_is_compiled_off_the_event_loop(api: httpx.AsyncClient, app: FastAPI, url: str,
                                                           body: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled_on: list[int] = []  # the threads where a constraint was compiled (not found in the cache)
    real = structured._problem

    def recorded(spec_json: str) -> str | None:
        misses = real.cache_info().misses
        try:
            return real(spec_json)
        finally:
            if real.cache_info().misses > misses:
                compiled_on.append(threading.get_ident())

    monkeypatch.setattr(structured, "_problem", recorded)
    body = copy.deepcopy(body)
    fmt = body.get("response_format") or body["text"]["format"]
    (fmt.get("json_schema") or fmt)["schema"] = schema()
    loop_thread = threading.get_ident()
    r = await api.post(url, json=body)
    assert r.status_code in (200, 202, 504), r.text  # admitted (no worker runs)
    assert len(compiled_on) == 1 and compiled_on[0] != loop_thread
