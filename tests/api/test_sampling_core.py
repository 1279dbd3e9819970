"""The sampling core (issue 44): temperature, top_p, stop, seed and the max_tokens bound are declared
once (protocol/messages.py), and every surface takes them from that declaration: the native routes
(a submitted body, the infer route's query over an Arrow body), OpenAI's completions and chat,
Responses, a batch's lines, the queued entry and what the engine is handed. So a bound is the same
everywhere: each surface refuses a value past it with the same 4xx naming the field, and takes the
value at it."""

from __future__ import annotations

import importlib
import json
import pkgutil
from typing import Any

import httpx
import pyarrow as pa
import pytest
from pydantic import ValidationError

from sluice.api.intake import Sampling
from sluice.api.schemas import CallOptions, SubmitRequest
from sluice.config.model import ModelConfig
from sluice.protocol.messages import (
    MAX_TOKENS,
    CallerSeed,
    Sampled,
    SamplingCore,
    SamplingSpec,
    StopStrings,
)
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest
from sluice.protocol.openai_responses import ResponseRequest
from sluice.workers.engines.base import GenerationRequest
from sluice.workers.jobs.lines import Line, Rules, parse_line
from tests.api.arrow_bodies import ARROW, ipc
from tests.broker.helpers import MODEL

CHAT = [{"role": "user", "content": "p"}]
# Each HTTP surface: its path, and a body that runs (max_tokens 2), the field under test added.
ROUTES = {
    "native": ("/v1/requests", {"prompt": "p", "max_tokens": 2}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "p", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "p", "max_output_tokens": 2}),
}
LINES = {  # a batch's line on each endpoint: its body
    "/v1/completions": ROUTES["completions"][1],
    "/v1/chat/completions": ROUTES["chat"][1],
    "/v1/responses": ROUTES["responses"][1],
}
# The field, a value just past its bound, and the bound itself; the message every surface answers.
BOUNDS = [
    ("temperature", 2.5, 2.0, "Input should be less than or equal to 2"),
    ("top_p", 1.5, 1.0, "Input should be less than or equal to 1"),
    ("seed", 2**63, 2**63 - 1, f"Input should be less than or equal to {2**63 - 1}"),
]


def sluice_classes() -> list[type]:
    """Every class defined in api/, protocol/ and workers/ (pydantic models, dataclasses, ...)."""
    found: list[type] = []
    for package in ("api", "protocol", "workers"):
        root = importlib.import_module(f"sluice.{package}")
        for info in pkgutil.walk_packages(root.__path__, f"sluice.{package}."):
            module = importlib.import_module(info.name)
            found += [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == info.name]
    return found


def test_each_core_field_is_declared_once_and_every_surface_inherits_it() -> None:
    classes = sluice_classes()
    declaring = {name: sorted(c.__qualname__ for c in classes if name in c.__dict__.get("__annotations__", {}))
                 for name in ("temperature", "top_p", "stop", "seed")}
    # A caller's seed is declared once too; the entry's is the one admission chose (the caller's
    # plus the choice's index, or drawn) and the engine's the row's (the entry's plus the row's index).
    assert declaring == {"temperature": ["SamplingCore"], "top_p": ["SamplingCore"], "stop": ["StopStrings"],
                         "seed": ["CallerSeed", "GenerationRequest", "SamplingSpec"]}
    takes_core = [SubmitRequest, CallOptions, CompletionRequest, ChatCompletionRequest, ResponseRequest, Sampling,
                  SamplingSpec, Sampled]
    assert all(issubclass(surface, SamplingCore) for surface in takes_core)
    assert all(issubclass(surface, StopStrings) for surface in takes_core if surface not in (CallOptions,
                                                                                              ResponseRequest))
    assert all(issubclass(surface, CallerSeed) for surface in (SubmitRequest, CallOptions, CompletionRequest,
                                                               ChatCompletionRequest, ResponseRequest, Sampling))
    assert GenerationRequest.__dataclass_fields__["sampling"].type in (Sampled, "Sampled")


def refusal(r: httpx.Response) -> tuple[int, str | None, str]:
    error = r.json()["error"]
    return r.status_code, error["param"], error["message"]


@pytest.mark.parametrize(("field", "past", "bound", "says"), BOUNDS, ids=[b[0] for b in BOUNDS])
async def test_every_http_surface_refuses_past_a_bound_and_takes_the_bound(
        api: httpx.AsyncClient, null_worker: object, field: str, past: float, bound: float, says: str) -> None:
    wait = {"Prefer": "wait=30"}
    for surface, (path, body) in ROUTES.items():
        r = await api.post(path, json={**body, field: past}, headers=wait)
        assert refusal(r) == (422, field, f"{field}: {says}"), (surface, r.text)
        r = await api.post(path, json={**body, field: bound}, headers=wait)
        assert r.status_code == 200, (surface, r.text)
    rows = ipc(pa.table({"prompt": ["p"], "max_tokens": [2]}))  # the infer route: an Arrow row, its query
    infer = f"/v1/models/{MODEL}/infer"
    r = await api.post(infer, params={field: past}, content=rows, headers={"content-type": ARROW})
    assert refusal(r) == (422, field, f"{field}: {says}"), r.text
    r = await api.post(infer, params={field: bound}, content=rows, headers={"content-type": ARROW})
    assert r.status_code == 200, r.text


def batch_line(url: str, body: dict[str, Any], rules: Rules | None = None) -> Line | dict[str, Any]:
    text = json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body})
    return parse_line(0, text, url, rules=rules)


@pytest.mark.parametrize(("field", "past", "bound", "says"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_a_batch_line_the_entry_and_the_engine_hold_the_same_bound(field: str, past: float, bound: float,
                                                                    says: str) -> None:
    for url, body in LINES.items():
        refused = batch_line(url, {**body, field: past})
        assert isinstance(refused, dict), url
        assert refused["error"] == {"code": "invalid_request", "message": f"line 1: body: {says} at {field}"}, url
        taken = batch_line(url, {**body, field: bound})
        assert isinstance(taken, Line) and getattr(taken.sampling, field) == bound, url
    if field != "seed":  # the entry's seed is the one admission chose: the caller's plus the choice's index
        with pytest.raises(ValidationError, match=field):
            SamplingSpec(max_tokens=2, seed=1, **{field: past})
        with pytest.raises(ValidationError, match=field):
            Sampled(**{field: past})


async def test_every_surface_refuses_max_tokens_past_the_bound_naming_it(api: httpx.AsyncClient) -> None:
    """One bound (MAX_TOKENS), each surface's own words as before: a 422 naming max_tokens."""
    past = MAX_TOKENS + 1
    for surface, (path, body) in ROUTES.items():
        key = "max_output_tokens" if surface == "responses" else "max_tokens"
        status, param, message = refusal(await api.post(path, json={**body, key: past}))
        assert (status, param) == (422, "max_tokens") and str(MAX_TOKENS) in message, (surface, message)
    r = await api.post(f"/v1/models/{MODEL}/infer", content=ipc(pa.table({"prompt": ["p"], "max_tokens": [past]})),
                       headers={"content-type": ARROW})
    assert refusal(r) == (422, "max_tokens", f"rows[0].max_tokens: must be from 1 to {MAX_TOKENS}")
    rules = Rules({MODEL: ModelConfig(name=MODEL)}, max_prompt_chars=100)
    for url, body in LINES.items():
        key = "max_output_tokens" if url == "/v1/responses" else "max_tokens"
        refused = batch_line(url, {**body, key: past}, rules)
        assert isinstance(refused, dict), url
        assert refused["error"] == {"code": "max_tokens", "message": f"line 1: max_tokens: at most {MAX_TOKENS}"}
