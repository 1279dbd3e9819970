"""`Prefer: wait=S` (RFC 7240) on submit: one call returns the final result when it is ready
within S seconds, and the usual 202 when it is not."""

from __future__ import annotations

import json

import httpx
import pytest

from sluice.api.requests import preferred_wait
from sluice.bench.sse import sse_events
from sluice.workers.worker import Worker
from tests.broker.helpers import MODEL

BODY = {"prompt": "say something", "max_tokens": 3}


async def test_a_request_ready_within_the_wait_is_answered_200_with_its_result(
        api: httpx.AsyncClient, null_worker: Worker) -> None:
    r = await api.post("/v1/requests", json=BODY, headers={"Prefer": "wait=30"})
    assert r.status_code == 200, r.text
    assert r.headers["Preference-Applied"] == "wait=30"
    body = r.json()
    assert body["status"] == "done" and body["model"] == MODEL
    assert body["output"]["num_output_tokens"] == 3
    # The same request, polled: one request, not two.
    assert (await api.get(f"/v1/requests/{body['id']}")).json()["output"] == body["output"]


async def test_a_request_not_ready_within_the_wait_is_a_202_that_can_be_polled(api: httpx.AsyncClient) -> None:
    # No worker runs: the request waits in the queue past the preferred wait.
    r = await api.post("/v1/requests", json=BODY, headers={"Prefer": "wait=0.2"})
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued" and r.headers["Preference-Applied"] == "wait=0.2"
    assert (await api.get(f"/v1/requests/{r.json()['id']}")).json()["status"] == "queued"


async def test_an_idempotent_repeat_with_a_wait_returns_the_first_requests_result(
        api: httpx.AsyncClient, null_worker: Worker) -> None:
    headers = {"Prefer": "wait=30", "Idempotency-Key": "prefer-1"}
    first = await api.post("/v1/requests", json=BODY, headers=headers)
    again = await api.post("/v1/requests", json=BODY, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["output"] == first.json()["output"]


@pytest.mark.parametrize(("header", "wait"), [
    ("wait=5", 5.0), ("WAIT = 2.5", 2.5), ("handling=lenient, wait=3", 3.0), ('wait="4"', 4.0),
    ("respond-async, wait=5", None), ("wait=soon", None), ("wait=-1", None), ("wait=0", None),
    ("wait=inf", None), ("wait=nan", None), ("", None), (None, None), ("return=minimal", None),
])
def test_the_prefer_header_is_read_as_rfc_7240_asks(header: str | None, wait: float | None) -> None:
    assert preferred_wait(header) == wait


async def test_an_unreadable_preference_is_ignored_not_refused(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/requests", json=BODY, headers={"Prefer": "wait=soon"})
    assert r.status_code == 202 and "Preference-Applied" not in r.headers


def nulls(value: object, at: str = "") -> list[str]:
    """Where a JSON answer holds a null."""
    if value is None:
        return [at or "."]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nulls(v, f"{at}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{at}[{i}]")]
    return []


async def test_a_final_leaves_absent_fields_out_wherever_it_is_shown(
        api: httpx.AsyncClient, null_worker: Worker) -> None:
    """No logprobs, tool calls or extra fields were asked for: the answer has no such keys, not
    five nulls (issue 30), from Prefer: wait, GET and the events' `done` alike."""
    r = await api.post("/v1/requests", json=BODY, headers={"Prefer": "wait=30"})
    assert r.status_code == 200, r.text
    waited = r.json()
    assert nulls(waited) == [] and set(waited["output"]) == {"text", "num_output_tokens", "finish_reason"}
    polled = (await api.get(f"/v1/requests/{waited['id']}")).json()
    assert polled == waited
    events = [e async for e in sse_events(await api.get(f"/v1/requests/{waited['id']}/events"))]
    assert events[-1].event == "done" and json.loads(events[-1].data) == waited
