"""The null engine steps on its own clock, as a GPU engine does in its own process: a worker
whose event loop is busy for a while gets the tokens made meanwhile at once, and the engine's
pace is not the worker's (what `sluice bench tokens` measures the worker against)."""

from __future__ import annotations

import asyncio
import time

from sluice.workers.engines.base import GenerationRequest
from sluice.workers.engines.null import NullEngine, _Steps


async def test_the_steps_a_busy_loop_missed_were_made_meanwhile() -> None:
    steps = _Steps(0.02)
    first = steps.next_step()
    made = steps.made(first)
    assert made is not None  # a step not yet taken is waited for
    await made
    time.sleep(0.1)  # the worker's event loop busy for five steps
    assert all(steps.made(first + k) is None for k in range(1, 5))  # made meanwhile: at once
    later = steps.made(first + 8)
    assert later is not None
    await later


async def test_the_waiters_of_a_step_get_it_together_and_a_cancelled_one_alone_leaves() -> None:
    steps = _Steps(0.02)
    step = steps.next_step() + 1
    a, b, c = steps.made(step), steps.made(step), steps.made(step)
    assert a is not None and b is not None and c is not None
    b.cancel()
    await a
    assert c.done() and not c.cancelled()


async def test_a_lagging_worker_still_gets_every_token_in_order() -> None:
    engine = NullEngine(token_delay_s=0.005)
    request = GenerationRequest(request_id="r", prompt="p", max_tokens=40)
    texts = []
    async for delta in engine.generate(request):
        texts.append(delta.text)
        if len(texts) % 10 == 0:
            time.sleep(0.03)  # busy past six steps: they come at once, none lost or doubled
    assert "".join(texts) == "".join(f" t{i}" for i in range(40))


async def test_two_engines_on_two_loops_each_keep_their_own_clock() -> None:
    engine = NullEngine(token_delay_s=0.002)
    request = GenerationRequest(request_id="r", prompt="p", max_tokens=3)
    assert len([d async for d in engine.generate(request)]) == 3
    got = await asyncio.to_thread(asyncio.run, _count(engine, request))
    assert got == 3


async def _count(engine: NullEngine, request: GenerationRequest) -> int:
    return len([d async for d in engine.generate(request)])
