"""The worker in-process with the null engine against a private Redis: run, bound, cancel, drain."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import pytest
from redis.asyncio import Redis

from sluice.broker.delivery.consumer import StreamConsumer
from sluice.broker.intake.admission import Admission
from sluice.broker.intake.cancels import Cancels
from sluice.broker.keys import GROUP, WORKERS, ModelKeys
from sluice.broker.limits import AdmissionLimits, ConsumerLimits
from sluice.broker.registry import WorkerRegistry
from sluice.config.batching import ContinuousBatchingConfig
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.messages import FinalResult, RequestMessage, SamplingSpec
from sluice.workers.engines.base import GenerationRequest, TokenDelta
from sluice.workers.engines.null import NullEngine
from sluice.workers.worker import Worker
from tests import fakes
from tests.broker.helpers import read_events

MODEL = "t"
KEYS = ModelKeys(MODEL)


class CountingEngine(NullEngine):
    """A null engine that counts the generate calls running at once."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.active = 0
        self.peak = 0
        self.calls = 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.active += 1
        self.calls += 1
        self.peak = max(self.peak, self.active)
        try:
            async for delta in super().generate(request):
                yield delta
        finally:
            self.active -= 1


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout_s: float = 15.0,
                     what: str = "condition") -> None:
    await fakes.eventually(check, timeout_s, what, interval_s=0.02)


def message(max_tokens: int = 3, *, deadline_in: float = 60.0) -> RequestMessage:
    now = time.time()
    return RequestMessage(
        id=f"req-{uuid.uuid4().hex}", model=MODEL,
        rows=[{"prompt": "say something nice", "max_tokens": max_tokens}],
        sampling=SamplingSpec(max_tokens=max_tokens, seed=1),
        enqueued_at=now, deadline=now + deadline_in,
    )


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # Heartbeats out of step with the 0.5 s fetch poll, so that a worker stopping when idle
    # does not cancel its heartbeat in the middle of a Redis call as a rule: that case has a
    # test of its own (test_stop_survives_a_redis_call_that_swallows_its_cancel).
    return settings.model_copy(update={"heartbeat_interval_s": 0.37})


@pytest.fixture
def admission(redis: Redis, settings: Settings) -> Admission:
    return Admission(redis, AdmissionLimits.of(settings))


@pytest.fixture
def cancels(redis: Redis, settings: Settings) -> Cancels:
    return Cancels(redis, AdmissionLimits.of(settings))


async def submit(admission: Admission, n: int = 1, **kw) -> list[RequestMessage]:
    out = [message(**kw) for _ in range(n)]
    for m in out:
        await admission.submit(m, max_queued=1000)
    return out


async def state(redis: Redis, rid: str) -> str | None:
    return await redis.hget(KEYS.status(rid), "state")


async def states(redis: Redis, msgs: list[RequestMessage]) -> list[str | None]:
    return [await state(redis, m.id) for m in msgs]


WorkerFactory = Callable[..., tuple[Worker, "asyncio.Task[None]"]]


@pytest.fixture
async def start_worker(redis: Redis, settings: Settings) -> AsyncIterator[WorkerFactory]:
    started: list[tuple[Worker, asyncio.Task[None]]] = []

    def start(engine: NullEngine, *, capacity: int = 4, name: str = "w") -> tuple[Worker, asyncio.Task[None]]:
        model = ModelConfig(name=MODEL, continuous_batching_config=ContinuousBatchingConfig(
            max_concurrent_batch_size=capacity))
        worker = Worker(settings, model, engine, redis, name)
        task = asyncio.create_task(worker.run(), name=f"worker-{name}")
        started.append((worker, task))
        return worker, task

    yield start
    for worker, _ in started:  # never leak a worker, whatever the test did
        worker.stopping.set()
    await asyncio.wait_for(asyncio.gather(*(t for _, t in started), return_exceptions=True), 30)


async def stop(worker: Worker, task: asyncio.Task[None]) -> None:
    worker.stopping.set()
    await asyncio.wait_for(task, 30)


async def test_requests_complete_with_deltas_then_final(
        redis: Redis, admission: Admission, start_worker: WorkerFactory) -> None:
    worker, task = start_worker(NullEngine(token_delay_s=0.005))
    msgs = await submit(admission, 3, max_tokens=4)
    await eventually(lambda: _all_done(redis, msgs), what="3 requests done")

    for m in msgs:
        events = await read_events(redis, m.id, idle_timeout_s=5)
        # One delta per token, or fewer when writes lag behind the engine (the writer joins a
        # request's waiting deltas): every token once, in order, each delta where the last ended.
        assert [e.kind for e in events] == ["delta"] * (len(events) - 1) + ["final"] and len(events) >= 2
        deltas = [e.delta for e in events[:-1]]
        assert [d.i for d in deltas] == [sum(len(p.token_ids) for p in deltas[:n]) for n in range(len(deltas))]
        assert sum(len(d.token_ids) for d in deltas) == 4 and "".join(d.text for d in deltas) == " t0 t1 t2 t3"
        final = events[-1].final
        assert final.status.value == "done"
        assert final.output.text == " t0 t1 t2 t3"
        assert final.output.num_output_tokens == 4
        assert final.usage.completion_tokens == 4
        assert final.usage.prompt_tokens == 3
        status = await redis.hgetall(KEYS.status(m.id))
        assert FinalResult.model_validate_json(status["result"]) == final
        assert await redis.ttl(KEYS.reply(m.id)) > 0
        assert await redis.ttl(KEYS.status(m.id)) > 0
    assert await redis.xlen(KEYS.requests) == 0
    assert await redis.xpending_range(KEYS.requests, GROUP, "-", "+", 10) == []
    await stop(worker, task)


async def _all_done(redis: Redis, msgs: list[RequestMessage]) -> bool:
    return await states(redis, msgs) == ["done"] * len(msgs)


async def test_a_one_shot_engine_answers_in_one_delta(
        redis: Redis, admission: Admission, start_worker: WorkerFactory) -> None:
    worker, task = start_worker(NullEngine())
    (m,) = await submit(admission, 1, max_tokens=5)
    await eventually(lambda: _all_done(redis, [m]), what="request done")
    events = await read_events(redis, m.id, idle_timeout_s=5)
    assert [e.kind for e in events] == ["delta", "final"]
    assert events[0].delta.token_ids == [0, 1, 2, 3, 4]
    assert events[1].final.output.num_output_tokens == 5
    await stop(worker, task)


async def test_never_more_than_the_capacity_in_flight(
        redis: Redis, admission: Admission, start_worker: WorkerFactory) -> None:
    engine = CountingEngine(delay_s=0.05)
    worker, task = start_worker(engine, capacity=4)
    msgs = await submit(admission, 20, max_tokens=2)
    peak_in_policy = 0

    async def done_and_watch() -> bool:
        nonlocal peak_in_policy
        peak_in_policy = max(peak_in_policy, worker.policy.in_flight)
        return await _all_done(redis, msgs)

    await eventually(done_and_watch, timeout_s=30, what="20 requests done")
    assert engine.calls == 20
    assert engine.peak <= 4
    assert engine.peak == 4  # and the slots were used: 20 queued requests fill all four
    assert peak_in_policy <= 4
    assert engine.active == 0
    await stop(worker, task)


async def test_cancel_stops_a_running_request(
        redis: Redis, admission: Admission, cancels: Cancels, start_worker: WorkerFactory) -> None:
    engine = CountingEngine(token_delay_s=0.02)
    worker, task = start_worker(engine)
    (m,) = await submit(admission, 1, max_tokens=5000)  # about 100 s if left alone
    await eventually(lambda: redis.xlen(KEYS.reply(m.id)), what="the first token delta")
    assert await state(redis, m.id) == "running"

    assert await cancels.cancel(MODEL, m.id) == "cancelling"
    # The request would run for about 100 s: ending within the (generous) wait, well short of
    # its max_tokens, is the cancel's doing, however slow the machine.
    await eventually(lambda: _is(redis, m.id, "cancelled"), what="state cancelled")
    await eventually(lambda: engine.active == 0 and not worker.running and worker.policy.in_flight == 0,
                     what="nothing in flight")

    events = await read_events(redis, m.id, idle_timeout_s=5)
    final = events[-1].final
    assert final.status.value == "cancelled"
    assert 0 < final.output.num_output_tokens < 5000
    assert await redis.xlen(KEYS.requests) == 0
    await stop(worker, task)


async def test_a_streaming_request_hears_of_its_cancel_from_the_reply_writes(
        redis: Redis, admission: Admission, cancels: Cancels, start_worker: WorkerFactory) -> None:
    """reply.lua's answer carries the cancel: with the flag reads answering nothing, a request
    whose tokens are being written is still cancelled (the watch reads flags only for requests
    it heard nothing of lately)."""
    engine = CountingEngine(token_delay_s=0.02)
    worker, task = start_worker(engine)
    async def no_flags(rids: list[str]) -> set[str]:
        return set()

    worker.consumer.cancelled = no_flags  # type: ignore[method-assign]
    (m,) = await submit(admission, 1, max_tokens=5000)
    await eventually(lambda: redis.xlen(KEYS.reply(m.id)), what="the first token delta")
    assert await cancels.cancel(MODEL, m.id) == "cancelling"
    await eventually(lambda: _is(redis, m.id, "cancelled"), what="state cancelled")
    events = await read_events(redis, m.id, idle_timeout_s=5)
    assert 0 < events[-1].final.output.num_output_tokens < 5000
    await stop(worker, task)


async def _is(redis: Redis, rid: str, wanted: str) -> bool:
    return await state(redis, rid) == wanted


async def test_a_request_past_its_deadline_while_running_expires(
        redis: Redis, admission: Admission, start_worker: WorkerFactory) -> None:
    engine = CountingEngine(token_delay_s=0.02)
    worker, task = start_worker(engine)
    (m,) = await submit(admission, 1, max_tokens=5000, deadline_in=1.0)
    await eventually(lambda: _is(redis, m.id, "expired"), timeout_s=10, what="state expired")
    await eventually(lambda: engine.active == 0, what="engine request aborted")  # not the 100 s run
    await stop(worker, task)


async def test_a_request_cancelled_while_queued_never_reaches_the_engine(
        redis: Redis, admission: Admission, cancels: Cancels, start_worker: WorkerFactory) -> None:
    (m,) = await submit(admission, 1)
    assert await cancels.cancel(MODEL, m.id) == "cancelled"
    engine = CountingEngine()
    worker, task = start_worker(engine)
    (after,) = await submit(admission, 1)  # proves the worker got past the cancelled one
    await eventually(lambda: _all_done(redis, [after]), what="the later request done")
    assert engine.calls == 1
    assert await state(redis, m.id) == "cancelled"
    assert await redis.xlen(KEYS.requests) == 0
    await stop(worker, task)


async def test_stopping_drains_running_requests(
        redis: Redis, admission: Admission, start_worker: WorkerFactory, settings: Settings) -> None:
    engine = CountingEngine(token_delay_s=0.05)
    worker, task = start_worker(engine, capacity=4, name="drainer")
    msgs = await submit(admission, 3, max_tokens=20)  # about 1 s each
    await eventually(lambda: engine.active == 3, what="three requests in the engine")
    await eventually(lambda: _registered(redis, "drainer"), what="the worker's heartbeat")

    worker.stopping.set()
    await asyncio.sleep(0)
    assert not task.done()
    await asyncio.wait_for(task, 30)

    assert await states(redis, msgs) == ["done"] * 3
    for m in msgs:
        result = FinalResult.model_validate_json(await redis.hget(KEYS.status(m.id), "result"))
        assert result.output.num_output_tokens == 20
    assert engine.active == 0
    assert await redis.xlen(KEYS.requests) == 0
    assert await redis.hget(WORKERS, "drainer") is None
    assert await redis.exists(KEYS.consumer_lock("drainer")) == 0


async def _registered(redis: Redis, name: str) -> bool:
    live = await WorkerRegistry(redis).live(ttl_s=10)
    return any(w.name == name and w.capacity == 4 and w.model == MODEL for w in live)


async def test_a_restarted_worker_finishes_what_it_held(
        redis: Redis, admission: Admission, settings: Settings, start_worker: WorkerFactory) -> None:
    (m,) = await submit(admission, 1, max_tokens=3)
    # the same worker's previous life fetched and started it, then died
    crashed = StreamConsumer(redis, MODEL, "phoenix", ConsumerLimits.of(settings, lease_timeout_s=30.0))
    await crashed.ensure_groups()
    (d,) = await crashed.fetch(1, 100)
    assert await crashed.start(d) == "run"

    engine = CountingEngine()
    worker, task = start_worker(engine, name="phoenix")
    await eventually(lambda: _all_done(redis, [m]), what="the held request done")
    final = FinalResult.model_validate_json(await redis.hget(KEYS.status(m.id), "result"))
    assert final.attempt == 2
    assert final.output.num_output_tokens == 3
    assert engine.calls == 1
    assert await redis.xlen(KEYS.requests) == 0
    await stop(worker, task)


async def test_an_idle_worker_stops_promptly(
        redis: Redis, settings: Settings, start_worker: WorkerFactory) -> None:
    # Every wait the worker could wrongly sit out on its way down (the drain timeout, a lease)
    # is far longer than the 30 s `stop` allows: stopping in time proves it waited for none of
    # them, with no stopwatch that a loaded machine could trip.
    settings.shutdown_timeout_s = 120.0
    settings.lease_timeout_s = 120.0
    worker, task = start_worker(NullEngine())
    await eventually(lambda: _registered(redis, "w"), what="the worker's heartbeat")  # up and fetching
    await stop(worker, task)


async def test_stop_survives_a_redis_call_that_swallows_its_cancel(start_worker: WorkerFactory) -> None:
    worker, task = start_worker(NullEngine())
    real_beat = worker.workers.beat
    entered = asyncio.Event()
    swallowed: list[bool] = []

    async def beat(info) -> None:
        if asyncio.current_task().get_name() == "heartbeat":
            entered.set()
            try:
                await asyncio.sleep(3600)  # a Redis call in flight when the duties are cancelled
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # what redis-py does on 3.11 when the write just finished
        await real_beat(info)

    worker.workers.beat = beat  # type: ignore[method-assign]
    await asyncio.wait_for(entered.wait(), 10)
    worker.stopping.set()
    # The swallowed cancel leaves a duty sleeping for an hour: a generous limit still tells a
    # hang from a slow machine.
    done, _ = await asyncio.wait({task}, timeout=30)
    if not done:  # clean up what the hung worker left behind, then report
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        await worker.replies.close()
        pytest.fail("Worker.run() did not return within 30 s of stopping: a background duty "
                    "that lost its cancel keeps running")
    assert swallowed == [True]
    assert task.exception() is None


class GatedEngine(NullEngine):
    """A null engine that records the order requests reach it (by prompt) and holds each one
    until `gate` opens, so that the test decides when slots free up."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.gate = asyncio.Event()
        self.admitted: list[str] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.admitted.append(request.prompt)
        await self.gate.wait()
        async for delta in super().generate(request):
            yield delta


async def submit_lane(admission: Admission, lane: Literal["interactive", "bulk"], n: int) -> list[RequestMessage]:
    out = []
    for i in range(n):
        m = message(max_tokens=3)
        m = m.model_copy(update={"lane": lane, "rows": [{"prompt": f"{lane} {i}", "max_tokens": 3}]})
        await admission.submit(m, max_queued=1000)
        out.append(m)
    return out


async def test_interactive_requests_overtake_bulk_work_queued_before_them(
        redis: Redis, admission: Admission, start_worker: WorkerFactory) -> None:
    """DESIGN: workers read the interactive lane first, so bulk work never delays interactive
    traffic. Bulk work fills the worker, more bulk work waits, then interactive requests arrive:
    every freed slot must go to them before any of the bulk work that was queued earlier."""
    bulk = await submit_lane(admission, "bulk", 6)
    engine = GatedEngine()
    worker, task = start_worker(engine, capacity=3)
    # Two slots hold bulk work, held at the gate; the third is reserved for interactive work
    # (SLUICE_INTERACTIVE_RESERVED_SLOTS), so bulk work takes nothing more until one frees.
    await eventually(lambda: len(engine.admitted) == 2, what="bulk work filling all but the reserved slot")
    interactive = await submit_lane(admission, "interactive", 3)
    engine.gate.set()
    await eventually(lambda: _all_done(redis, bulk + interactive), timeout_s=30, what="all nine done")

    # Entries fetched together start in any order (each first records its start in Redis).
    assert sorted(engine.admitted[:2]) == ["bulk 0", "bulk 1"]
    # Without the interactive lane first, "bulk 2".."bulk 5" (queued earlier) would come next.
    assert sorted(engine.admitted[2:5]) == ["interactive 0", "interactive 1", "interactive 2"], engine.admitted
    assert sorted(engine.admitted[5:]) == ["bulk 2", "bulk 3", "bulk 4", "bulk 5"]
    await stop(worker, task)

