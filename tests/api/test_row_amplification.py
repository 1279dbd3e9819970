"""One OpenAI call's cost is bounded before any per-row work (issue 29, finding 1): prompts × n
over max_choices_per_call is a 413, and a call that cannot fit the queue bound is a 503, both
before a row is checked or a message built; a call is admitted whole or not at all."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.api import intake
from sluice.broker.keys import ModelKeys
from sluice.protocol.tokens import Measured
from tests.api.conftest import StartApi
from tests.broker.helpers import MODEL, queued_len

CAP = 64
MAX_QUEUED = 40
ADMITTED = 504  # no worker runs: an admitted call waits max_wait_s for its results, its choices stay queued


@pytest.fixture
async def app(start_api: StartApi) -> AsyncIterator[FastAPI]:  # conftest's `api` client talks to it
    async with start_api(max_choices_per_call=CAP, max_queued=MAX_QUEUED, max_wait_s=0.05) as built:
        yield built


@pytest.fixture
def rows_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rows the intake checked (the per-row work a refusal must come before)."""
    seen: list[int] = []
    real = intake.checked_rows

    def counted(model, rows, **kw):  # type: ignore[no-untyped-def]
        seen.append(len(rows))
        return real(model, rows, **kw)

    monkeypatch.setattr(intake, "checked_rows", counted)
    return seen


async def queued(redis: Redis) -> int:
    """Entries queued on both lanes, staged ones (fair share) included."""
    keys = ModelKeys(MODEL)
    return await queued_len(redis, keys.requests) + await queued_len(redis, keys.bulk)


def completion(prompts: int, n: int = 1, **extra: object) -> dict:
    return {"model": MODEL, "prompt": [f"p{i}" for i in range(prompts)], "n": n, "max_tokens": 4, **extra}


@pytest.mark.parametrize(("prompts", "n"), [(20_000, 16), (CAP + 1, 1), (5, 16), (CAP // 2 + 1, 2)])
async def test_too_many_choices_is_a_413_before_any_row_is_checked(
        api: httpx.AsyncClient, redis: Redis, rows_checked: list[int], prompts: int, n: int) -> None:
    r = await api.post("/v1/completions", json=completion(prompts, n))
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "SLUICE_MAX_CHOICES_PER_CALL" in error["message"]
    assert f"{prompts * n} choices" in error["message"]
    assert rows_checked == [] and await queued(redis) == 0


async def test_a_call_the_queue_cannot_hold_is_a_503_before_any_row_is_checked(
        api: httpx.AsyncClient, redis: Redis, rows_checked: list[int]) -> None:
    r = await api.post("/v1/completions", json=completion(MAX_QUEUED + 1))
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and rows_checked == []
    assert (await api.post("/v1/completions", json=completion(MAX_QUEUED - 3))).status_code == ADMITTED
    rows_checked.clear()
    r = await api.post("/v1/completions", json=completion(2, n=2))  # 4 > the 3 left
    assert r.status_code == 503 and rows_checked == []
    assert await queued(redis) == MAX_QUEUED - 3


@pytest.mark.parametrize("seed", range(4))
async def test_concurrent_calls_are_admitted_whole_or_not_at_all(api: httpx.AsyncClient, redis: Redis,
                                                                 seed: int) -> None:
    """Many calls of random sizes race for the bound: each one's choices are all queued or none
    are, and the queue never holds more than the bound (the XLEN pre-check is only a hint)."""
    rnd = random.Random(seed)
    sizes = [(rnd.randint(1, 12), rnd.choice([1, 2, 3])) for _ in range(12)]
    answers = await asyncio.gather(*(api.post("/v1/completions", json=completion(p, n))
                                     for p, n in sizes))
    admitted = sum(p * n for (p, n), r in zip(sizes, answers) if r.status_code == ADMITTED)
    assert all(r.status_code in (ADMITTED, 503) for r in answers), [r.text for r in answers]
    assert await queued(redis) == admitted <= MAX_QUEUED
    # what was refused would not have fitted when it was refused: whatever is left is less than it
    smallest_refused = min((p * n for (p, n), r in zip(sizes, answers) if r.status_code == 503), default=None)
    if smallest_refused is not None:
        assert MAX_QUEUED - admitted < smallest_refused


async def test_the_choices_of_one_prompt_are_measured_once(api: httpx.AsyncClient, redis: Redis,
                                                           app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []

    async def measure(model, row, max_tokens: int) -> Measured:  # type: ignore[no-untyped-def]
        measured.append(row["prompt"])
        return Measured()

    monkeypatch.setattr(app.state.sluice.intake.prompt_limits, "measure", measure)
    r = await api.post("/v1/completions", json=completion(3, n=8))
    assert r.status_code == ADMITTED, r.text
    assert sorted(measured) == ["p0", "p1", "p2"] and await queued(redis) == 24
