"""The worker process: broker -> batching policy -> engine -> broker.

One stable consumer per worker. Background tasks keep the leases of running requests
fresh, watch cancel flags and deadlines, and publish a heartbeat; none of them runs on
the engine's path, so a busy engine cannot starve them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis

from sluice.batching.base import BatchingPolicy
from sluice.batching.continuous import ContinuousAdmission
from sluice.broker.consumer import Delivery, StreamConsumer
from sluice.broker.messages import DeltaEvent, FinalResult, RowOutput, State, Timings, Usage
from sluice.broker.registry import WorkerInfo, WorkerRegistry
from sluice.broker.replies import ReplyWriter
from sluice.config.model import BatchMode, ModelConfig
from sluice.config.settings import Settings
from sluice.workers.engines.base import Engine, GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class RowResult:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class Running:
    """A request the engine is working on."""

    delivery: Delivery
    started: float
    engine_ids: list[str]
    first_token: float | None = None
    stop_reason: State | None = None  # CANCELLED / EXPIRED once aborted for that reason
    lost: bool = False  # reclaimed by another worker: finish quietly, commit nothing


def make_policy(model: ModelConfig) -> BatchingPolicy[Delivery]:
    if model.mode is BatchMode.CONTINUOUS:
        return ContinuousAdmission(model.continuous)
    raise NotImplementedError(f"batching mode {model.mode.value} is not available yet")


class Worker:
    def __init__(self, settings: Settings, model: ModelConfig, engine: Engine, redis: Redis, name: str):
        self.settings = settings
        self.model = model
        self.engine = engine
        self.redis = redis
        self.name = name
        self.consumer = StreamConsumer(
            redis, model.name, name,
            status_ttl_s=settings.status_ttl_s, reply_ttl_s=settings.reply_ttl_s,
            log_max_len=settings.log_max_len,
        )
        self.replies = ReplyWriter(redis, model.name, reply_ttl_s=settings.reply_ttl_s)
        self.workers = WorkerRegistry(redis)
        self.policy = make_policy(model)
        self.running: dict[str, Running] = {}
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self._background: list[asyncio.Task] = []

    # -- the Source the batching policy pulls from
    async def fetch(self, count: int, timeout_s: float) -> list[Delivery]:
        try:
            return await self.consumer.fetch(count, int(timeout_s * 1000))
        except Exception as err:  # Redis away: say so, wait, and try again
            log.warning("fetching from Redis failed (%s: %s); retrying", type(err).__name__, err)
            await asyncio.sleep(min(timeout_s, 1.0))
            return []

    async def run(self) -> None:
        self.name = await self.consumer.claim_name(self.settings.worker_ttl_s)
        await self.consumer.ensure_groups()
        await self.engine.start()
        self.replies.start()
        self._background = [
            asyncio.create_task(self._every(self.settings.heartbeat_interval_s, self._heartbeat), name="heartbeat"),
            asyncio.create_task(self._every(self.settings.lease_timeout_s / 3, self._lease), name="lease"),
            asyncio.create_task(self._every(self.settings.cancel_poll_s, self._watch), name="watch"),
        ]
        await self._heartbeat()
        log.info("worker %s serving model %s v%d (%s batching, capacity %d)",
                 self.name, self.model.name, self.model.version, self.model.mode.value, self.policy.capacity)
        try:
            await self.policy.run(self, self._handle, self.stopping)
            log.info("worker %s stops fetching; draining %d running request(s)", self.name, len(self.running))
            await self._heartbeat("draining")
            left = await self.policy.drain(self.settings.shutdown_timeout_s)
            if left:
                log.warning("%d request(s) still running after %.0fs: left to be reclaimed",
                            len(self.running), self.settings.shutdown_timeout_s)
                for r in list(self.running.values()):
                    r.lost = True
                    for eid in r.engine_ids:
                        await self.engine.abort(eid)
                await self.policy.drain(5.0)
        finally:
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await self.replies.close()
            await self.workers.remove(self.name)
            await self.consumer.release_name()
            await self.engine.shutdown()

    # -- one batch (a list of deliveries) from the policy
    async def _handle(self, batch: list[Delivery]) -> None:
        await asyncio.gather(*(self._run_request(d) for d in batch))

    async def _run_request(self, d: Delivery) -> None:
        rid = d.message.id
        decision = await self.consumer.start(d)
        if decision != "run":
            log.info("request %s not run: %s", rid, decision)
            return
        n_rows = len(d.message.rows)
        engine_ids = [rid] if n_rows == 1 else [f"{rid}:{i}" for i in range(n_rows)]
        run = Running(d, time.time(), engine_ids)
        self.running[rid] = run
        error: str | None = None
        try:
            results = await asyncio.gather(*(self._generate_row(run, i) for i in range(n_rows)))
        except Exception as err:
            log.exception("request %s failed in the engine", rid)
            error, results = f"{type(err).__name__}: {err}", []
        finally:
            del self.running[rid]
        if run.lost:
            return
        await self.replies.flush()
        await self.consumer.commit(d, self._final(run, results, error))

    async def _generate_row(self, run: Running, row: int) -> RowResult:
        msg = run.delivery.message
        values = msg.rows[row]
        s = msg.sampling
        request = GenerationRequest(
            request_id=run.engine_ids[row],
            prompt=values["prompt"],
            max_tokens=int(values.get("max_tokens") or s.max_tokens),
            temperature=s.temperature,
            top_p=s.top_p,
            stop=s.stop,
            seed=s.seed + row,
        )
        result = RowResult()
        async for delta in self.engine.generate(request):
            if delta.prompt_tokens is not None:
                result.prompt_tokens = delta.prompt_tokens
            if delta.token_ids:
                if run.first_token is None:
                    run.first_token = time.time()
                self.replies.delta(msg.id, DeltaEvent(
                    i=result.tokens, text=delta.text, token_ids=delta.token_ids,
                    attempt=run.delivery.attempt, row=row,
                ))
                result.text.append(delta.text)
                result.tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                result.finish_reason = delta.finish_reason
        return result

    def _final(self, run: Running, results: list[RowResult], error: str | None) -> FinalResult:
        msg = run.delivery.message
        timings = Timings(enqueued=msg.enqueued_at, started=run.started,
                          first_token=run.first_token, finished=time.time())
        outputs = [RowOutput(text="".join(r.text), num_output_tokens=r.tokens,
                             finish_reason=r.finish_reason) for r in results]
        usage = Usage(prompt_tokens=sum(r.prompt_tokens for r in results),
                      completion_tokens=sum(r.tokens for r in results))
        if run.stop_reason is not None:
            status = run.stop_reason
            error = ("cancelled by the client" if status is State.CANCELLED
                     else "the request passed its deadline while running")
        else:
            status = State.FAILED if error else State.DONE
        return FinalResult(
            status=status,
            output=outputs[0] if len(outputs) == 1 else None,
            rows=outputs if len(msg.rows) > 1 and outputs else None,
            error=error, usage=usage, timings=timings, attempt=run.delivery.attempt,
        )

    # -- background duties
    async def _every(self, interval_s: float, duty) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await duty()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("%s failed (%s: %s)", duty.__name__.strip("_"), type(err).__name__, err)

    async def _heartbeat(self, state: str = "running") -> None:
        if self.stopping.is_set():
            state = "draining"
        await self.workers.beat(WorkerInfo(
            name=self.name, model=self.model.name, version=self.model.version,
            mode=self.model.mode.value, pid=os.getpid(), host=socket.gethostname(),
            in_flight=len(self.running), capacity=self.policy.capacity,
            started_at=self.started_at, heartbeat_at=0.0, state=state,
        ))
        await self.consumer.refresh_name(self.settings.worker_ttl_s)

    async def _lease(self) -> None:
        runs = list(self.running.values())
        if not runs:
            return
        lost = set(await self.consumer.lease([r.delivery for r in runs]))
        for r in runs:
            if r.delivery.entry_id in lost and not r.lost:
                log.warning("request %s was reclaimed by another worker: aborting here", r.delivery.message.id)
                r.lost = True
                await self._abort(r)

    async def _watch(self) -> None:
        runs = {rid: r for rid, r in self.running.items() if r.stop_reason is None and not r.lost}
        if not runs:
            return
        now = time.time()
        for rid in await self.consumer.cancelled(list(runs)):
            runs[rid].stop_reason = State.CANCELLED
            await self._abort(runs[rid])
        for r in runs.values():
            if r.stop_reason is None and now > r.delivery.message.deadline:
                r.stop_reason = State.EXPIRED
                await self._abort(r)

    async def _abort(self, run: Running) -> None:
        for eid in run.engine_ids:
            await self.engine.abort(eid)
