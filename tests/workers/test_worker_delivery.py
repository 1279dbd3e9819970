"""The worker's half of "exactly one visible result", in-process with the null engine:
held entries stay leased through long batches, retries resume after what was streamed,
and a stop is never lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluice.broker.delivery.consumer import StreamConsumer
from sluice.broker.intake.admission import Admission
from sluice.broker.keys import GROUP
from sluice.broker.limits import AdmissionLimits, ConsumerLimits
from sluice.broker.registry import ModelRegistry
from sluice.broker.replies.writer import ReplyWriter
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, FinalResult, StructuredSpec, TokenLogprob
from sluice.workers.engines.base import GenerationRequest, TokenDelta
from sluice.workers.engines.null import NullEngine
from sluice.workers.worker import Worker
from tests.broker.helpers import read_events
from tests.workers.test_worker_null import KEYS, MODEL, eventually, message, submit

DYNAMIC = DynamicBatchingConfig(max_batch_delay_ms=10, batch_size_target=4, batch_size_limit=4)


class RecordingEngine(NullEngine):
    """The strict null engine, remembering every request it was given."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        async for delta in super().generate(request):
            yield delta


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.2})


@pytest.fixture
def admission(redis: Redis, settings: Settings) -> Admission:
    return Admission(redis, AdmissionLimits.of(settings))


@pytest.fixture
async def workers(redis: Redis, settings: Settings) -> AsyncIterator[list[tuple[Worker, asyncio.Task[None]]]]:
    started: list[tuple[Worker, asyncio.Task[None]]] = []
    yield started
    for worker, _ in started:
        worker.stopping.set()
    await asyncio.wait_for(asyncio.gather(*(t for _, t in started), return_exceptions=True), 30)


async def start(redis: Redis, settings: Settings, started: list, engine: NullEngine, model: ModelConfig,
                name: str = "w") -> Worker:
    await ModelRegistry(redis).deploy(model)
    worker = Worker(settings, model, engine, redis, name)
    started.append((worker, asyncio.create_task(worker.run())))
    return worker


async def final_of(redis: Redis, rid: str) -> FinalResult:
    return FinalResult.model_validate_json(await redis.hget(KEYS.status(rid), "result"))


async def is_final(redis: Redis, rid: str) -> bool:
    return await redis.hget(KEYS.status(rid), "result") is not None


async def streamed(redis: Redis, rid: str) -> str:
    events = await read_events(redis, rid, idle_timeout_s=5)
    assert events[-1].kind == "final"
    return "".join(e.delta.text for e in events if e.kind == "delta")


async def died_after_streaming(redis: Redis, settings: Settings, *deltas: DeltaEvent) -> None:
    """A worker that fetched the queued request, streamed `deltas`, and died (lease long gone)."""
    dead = StreamConsumer(redis, MODEL, "dead", ConsumerLimits.of(settings, lease_timeout_s=30.0))
    await dead.ensure_groups()
    (d,) = await dead.fetch(1, 100)
    assert await dead.start(d) == "run"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for ev in deltas:
        writer.delta(d, ev)
    await writer.flush()
    await redis.xclaim(KEYS.requests, GROUP, "dead", 0, [d.entry_id], idle=10_000_000, justid=True)


async def test_a_dynamic_batch_longer_than_the_lease_keeps_its_waiting_entries(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    """A waits in no batch (it runs, 2 s); B arrives 0.3 s later and waits for the next batch
    past the 1 s lease: its entry must stay this worker's, and run once, on attempt 1."""
    engine = RecordingEngine(token_delay_s=0.05)
    await start(redis, settings, workers, engine, ModelConfig(name=MODEL, dynamic_batching_config=DYNAMIC))
    (a,) = await submit(admission, 1, max_tokens=40)
    await eventually(lambda: redis.exists(KEYS.reply(a.id)), what="A running")
    await asyncio.sleep(0.3)
    (b,) = await submit(admission, 1, max_tokens=3)
    await eventually(lambda: is_final(redis, b.id), timeout_s=30, what="B final")
    for m in (a, b):
        await eventually(lambda m=m: is_final(redis, m.id), timeout_s=30, what="final")
        final = await final_of(redis, m.id)
        assert (final.status.value, final.attempt) == ("done", 1), final
    assert sorted(r.request_id for r in engine.requests) == sorted([a.id, b.id])


async def test_a_retry_resumes_after_the_streamed_tokens(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    """Attempt 1 streamed two tokens and died. Attempt 2 runs where the tokens depend on the
    batch composition (as a real engine's can): regenerating would disagree with what the
    client already saw; resuming cannot."""
    (m,) = await submit(admission, 1, max_tokens=6)
    await died_after_streaming(redis, settings, DeltaEvent(i=0, text=" t0.9 t1.9", token_ids=[0, 1]))

    engine = RecordingEngine(token_delay_s=0.005, composition=True)
    await start(redis, settings, workers, engine,
                ModelConfig(name=MODEL, continuous_batching_config=ContinuousBatchingConfig(
                    max_concurrent_batch_size=4)))
    await eventually(lambda: is_final(redis, m.id), timeout_s=30, what="final")
    final = await final_of(redis, m.id)
    assert (final.status.value, final.attempt, final.output.num_output_tokens) == ("done", 2, 6)
    assert final.output.text.startswith(" t0.9 t1.9 t2.")
    assert await streamed(redis, m.id) == final.output.text
    (request,) = engine.requests
    assert (request.resume_token_ids, request.max_tokens) == ([0, 1], 4)


async def test_a_retry_keeps_every_tokens_logprob(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    m = message(5)
    m.sampling.logprobs = 1
    await admission.submit(m, max_queued=10)
    earlier = [TokenLogprob(token=" t0", logprob=-3.0), TokenLogprob(token=" t1", logprob=-4.0)]
    await died_after_streaming(redis, settings, DeltaEvent(i=0, text=" t0 t1", token_ids=[0, 1], logprobs=earlier))
    engine = RecordingEngine(token_delay_s=0.005)
    await start(redis, settings, workers, engine, ModelConfig(name=MODEL, dynamic_batching_config=DYNAMIC))
    await eventually(lambda: is_final(redis, m.id), timeout_s=30, what="final")
    final = await final_of(redis, m.id)
    assert final.output.num_output_tokens == 5
    assert [t.logprob for t in final.output.logprobs] == [-3.0, -4.0, -0.5, -0.5, -0.5]  # streamed, then new


async def test_a_structured_retry_generates_again_and_streams_only_what_is_new(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    """A grammar cannot start mid-output: the retry regenerates from the start (same seed)
    and writes only the tokens the reply stream does not hold yet."""
    m = message(5)
    m.sampling.structured = StructuredSpec(json_object=True)
    await admission.submit(m, max_queued=10)
    await died_after_streaming(redis, settings, DeltaEvent(i=0, text=" t0 t1", token_ids=[0, 1]))
    engine = RecordingEngine(token_delay_s=0.005)
    await start(redis, settings, workers, engine, ModelConfig(name=MODEL, dynamic_batching_config=DYNAMIC))
    await eventually(lambda: is_final(redis, m.id), timeout_s=30, what="final")
    final = await final_of(redis, m.id)
    assert (final.output.text, final.output.num_output_tokens) == (" t0 t1 t2 t3 t4", 5)
    (request,) = engine.requests
    assert (request.resume_token_ids, request.max_tokens, request.structured) == ([], 5, m.sampling.structured)
    entries = await redis.xrange(KEYS.reply(m.id))
    indices = [DeltaEvent.model_validate_json(f["data"]).i for _, f in entries if f["kind"] == "delta"]
    assert indices == sorted(set(indices)) and indices[0] == 0  # no token written twice
    assert await streamed(redis, m.id) == final.output.text


async def test_an_interactive_request_starts_beside_a_flood_of_low_priority_work(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    """Bulk-lane work (batch jobs, priority above 0) never takes the worker's last slot: an
    interactive request arriving behind it runs at once, not after it."""
    flood = [message(60) for _ in range(8)]  # 3 s each, far longer than the interactive one
    for m in flood:
        m.lane = "bulk"
        await admission.submit(m, max_queued=100)
    engine = RecordingEngine(token_delay_s=0.05)
    await start(redis, settings, workers, engine, ModelConfig(
        name=MODEL, continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=4)))
    await eventually(lambda: len(engine.requests) == 3, what="the flood to fill all but the reserved slot")
    (urgent,) = await submit(admission, 1, max_tokens=2)
    await eventually(lambda: is_final(redis, urgent.id), timeout_s=30, what="the interactive request")
    assert not [m.id for m in flood if await is_final(redis, m.id)]  # done while all the flood still runs


async def test_a_retry_after_the_last_token_runs_nothing(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    (m,) = await submit(admission, 1, max_tokens=5)
    await died_after_streaming(redis, settings, DeltaEvent(i=0, text=" a b", token_ids=[7, 8], finish="stop"))
    engine = RecordingEngine()
    await start(redis, settings, workers, engine, ModelConfig(name=MODEL, dynamic_batching_config=DYNAMIC))
    await eventually(lambda: is_final(redis, m.id), timeout_s=30, what="final")
    final = await final_of(redis, m.id)
    assert (final.output.text, final.output.num_output_tokens, final.output.finish_reason) == (" a b", 2, "stop")
    assert engine.requests == []


async def test_a_stop_during_a_version_switch_is_not_lost(
        redis: Redis, settings: Settings, admission: Admission, workers: list) -> None:
    engine = RecordingEngine(token_delay_s=0.05)
    model = ModelConfig(name=MODEL, continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=4))
    worker = await start(redis, settings, workers, engine, model)
    (m,) = await submit(admission, 1, max_tokens=60)  # 3 s: still running when the stop comes
    await eventually(lambda: redis.exists(KEYS.reply(m.id)), what="running")
    await ModelRegistry(redis).deploy(ModelConfig(name=MODEL, dynamic_batching_config=DYNAMIC))
    await eventually(lambda: worker._switch.is_set(), what="the switch started")
    worker.stopping.set()  # SIGTERM while the old policy drains
    _, task = workers[0]
    await asyncio.wait_for(task, 30)
    assert await redis.hget(KEYS.status(m.id), "state") == "done"
