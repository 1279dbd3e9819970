"""The load generator's arrivals, concurrency cap and figures, with a fake target."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.bench.loadgen import LoadRequest, Record, drive, make_requests, summarize


def fake_target(token_s: float = 0.002, first_s: float = 0.01):
    state = {"running": 0, "peak": 0}

    async def send(request: LoadRequest) -> Record:
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        rec = Record(start=time.perf_counter())
        await asyncio.sleep(first_s)
        for _ in range(request.max_tokens):
            now = time.perf_counter()
            rec.ttft = rec.ttft if rec.ttft is not None else now - rec.start
            rec.token_times.append(now)
            await asyncio.sleep(token_s)
        rec.end, rec.ok, rec.output_tokens, rec.queue_wait = time.perf_counter(), True, request.max_tokens, 0.001
        state["running"] -= 1
        return rec

    return send, state


def test_jobs_are_reproducible_and_in_range() -> None:
    requests = make_requests(50, (3, 9), (16, 32), seed=4)
    assert requests == make_requests(50, (3, 9), (16, 32), seed=4)
    assert all(3 <= len(j.prompt.split()) <= 9 and 16 <= j.max_tokens <= 32 for j in requests)
    assert requests != make_requests(50, (3, 9), (16, 32), seed=5)


async def test_concurrency_cap_and_figures() -> None:
    send, state = fake_target()
    records, wall = await drive(send, make_requests(24, (2, 4), (5, 5), 0), rate=None, poisson=False,
                                concurrency=4, seed=0)
    assert state["peak"] == 4
    figures = summarize(records, wall, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert figures["completed"] == 24 and figures["failed"] == 0
    assert figures["output_token_throughput"] == pytest.approx(24 * 5 / wall)
    assert figures["goodput"] == pytest.approx(24 / wall)
    assert 0.005 < figures["ttft"]["p50"] < 0.5
    assert figures["itl"]["p50"] is not None and figures["tpot"]["p99"] >= figures["tpot"]["p50"]
    strict = summarize(records, wall, slo_ttft_s=0.0001, slo_tpot_s=1.0)
    assert strict["goodput"] == 0  # nobody meets an impossible SLO


async def test_fixed_rate_spreads_arrivals() -> None:
    send, _ = fake_target(token_s=0.0, first_s=0.0)
    _, wall = await drive(send, make_requests(10, (1, 1), (1, 1), 0), rate=50.0, poisson=False, concurrency=None,
                          seed=0)
    assert wall >= 10 / 50 * 0.9  # ten arrivals 20 ms apart
