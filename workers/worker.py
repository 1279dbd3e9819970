"""The worker process: broker -> batching policy -> engine -> broker.

One stable consumer per worker. Background tasks keep the leases of running requests
fresh, watch cancel flags and deadlines, publish a heartbeat and notice a new version of
the deployment; none of them runs on the engine's path, so a busy engine cannot starve
them. A new batching configuration takes effect between batches: the current policy
stops fetching, its batches finish, and the new policy starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.batching.base import BatchingPolicy
from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.dynamic import DynamicBatcher
from sluice.batching.single import SingleBatcher
from sluice.broker.consumer import Delivery, StreamConsumer
from sluice.broker.registry import ModelRegistry, WorkerInfo, WorkerRegistry
from sluice.broker.replies import Delivered, ReplyWriter, delivered
from sluice.config.model import BatchMode, ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, FinalResult, RowOutput, Timings, Usage
from sluice.protocol.states import State
from sluice.workers import metrics
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
    prompt_tokens: int = 0
    stop_reason: State | None = None  # CANCELLED / EXPIRED once aborted for that reason
    lost: bool = False  # reclaimed by another worker: finish quietly, commit nothing


def make_policy(model: ModelConfig) -> BatchingPolicy[Delivery]:
    if model.mode is BatchMode.DYNAMIC:
        assert model.dynamic_batching_config is not None
        return DynamicBatcher(model.dynamic_batching_config)
    if model.mode is BatchMode.SINGLE:
        return SingleBatcher()
    return ContinuousAdmission(model.continuous)


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
            log_max_len=settings.log_max_len, lease_timeout_s=settings.lease_timeout_s,
            max_deliveries=model.max_deliveries or settings.max_deliveries, dlq_max_len=settings.dlq_max_len,
            result_ttl_s=model.result_ttl_s or settings.result_ttl_s,
            log_max_record_bytes=settings.log_max_record_bytes,
        )
        # An unfinished request's reply stream lives as long as its status: a retry resumes
        # from it. The final shortens it to reply_ttl_s.
        self.replies = ReplyWriter(redis, model.name, reply_ttl_s=settings.status_ttl_s)
        self.workers = WorkerRegistry(redis)
        self.models = ModelRegistry(redis)
        self.policy = make_policy(model)
        self.running: dict[str, Running] = {}
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self._switch = asyncio.Event()  # stops the current policy for a new version or shutdown
        self._closing = asyncio.Event()  # ends the background duties
        self._batches = 0
        self._counted = (0, 0)  # the consumer's reclaims and dead letters already in the metrics
        self._background: list[asyncio.Task] = []

    # -- the Source the batching policy pulls from
    async def fetch(self, count: int, timeout_s: float, isolated: int = 1) -> list[Delivery]:
        try:
            return await self.consumer.fetch(count, int(timeout_s * 1000), isolated=isolated)
        except Exception as err:
            if isinstance(err, ResponseError) and "NOGROUP" in str(err):
                log.warning("the consumer group of %s is gone (Redis restarted without its data, or was "
                            "flushed): re-creating it", self.model.name)
                await self.consumer.ensure_groups()
                return []
            # Redis away: say so, wait, and try again
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
            asyncio.create_task(self._every(6 * self.settings.worker_ttl_s, self.consumer.prune_consumers),
                                name="prune"),
            asyncio.create_task(self._forward_stop(), name="stop"),
        ]
        await self._heartbeat()
        try:
            while not self.stopping.is_set():
                log.info("worker %s serving model %s v%d (%s batching, capacity %d)", self.name,
                         self.model.name, self.model.version, self.model.mode.value, self.policy.capacity)
                await self.policy.run(self, self._handle, self._switch)
                if self.stopping.is_set():
                    break
                # A new version: let the current batches finish, then switch policies. A stop
                # that arrives meanwhile wins: the drain below then honours the shutdown timeout.
                while self.policy.in_flight and not self.stopping.is_set():
                    await self.policy.drain(0.2)
                if self.stopping.is_set():
                    break
                self.policy = make_policy(self.model)
                self._switch.clear()
            await self._drain()
        finally:
            # Background duties end on a flag, not on cancellation alone: a cancel that lands
            # as a Redis call completes can be swallowed by the client (asyncio.wait_for on 3.11).
            self._closing.set()
            _, late = await asyncio.wait(self._background, timeout=5.0)
            for task in late:
                task.cancel()
            await self.replies.close()
            await self.workers.remove(self.name)
            await self.consumer.release_name()
            await self.engine.shutdown()

    async def _forward_stop(self) -> None:
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([stop, asyncio.ensure_future(self._closing.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        self._switch.set()

    async def _drain(self) -> None:
        log.info("worker %s stops fetching; draining %d running request(s)", self.name, len(self.running))
        await self._heartbeat()
        if await self.policy.drain(self.settings.shutdown_timeout_s):
            log.warning("%d request(s) still running after %.0fs: left to be reclaimed",
                        len(self.running), self.settings.shutdown_timeout_s)
            for r in list(self.running.values()):
                r.lost = True
                await self._abort(r)
            await self.policy.drain(5.0)

    # -- one batch (a list of deliveries) from the policy
    async def _handle(self, batch: list[Delivery]) -> None:
        self._batches += 1
        metrics.BATCH_SIZE.labels(self.model.name, self.model.mode.value).observe(len(batch))
        batch_id = f"{self.name}-{self.started_at:.0f}-{self._batches}"
        released = time.time()
        logs = await asyncio.gather(*(self._run_request(d) for d in batch), return_exceptions=True)
        records, position = [], 0
        for d, rows in zip(batch, logs):
            if isinstance(rows, BaseException):
                # Redis away at start or commit: the entry stays pending and is retried.
                log.error("request %s: %s: %s", d.message.id, type(rows).__name__, rows)
                continue
            for record in rows:
                records.append({"batch_id": batch_id, "position": position, "batch_size": len(batch),
                                "released": released, **record})
                position += 1
        try:
            await self.consumer.append_log(records)
        except Exception as err:  # the log is for operators: a failed write must not fail requests
            log.warning("inference log write failed: %s", err)

    async def _run_request(self, d: Delivery) -> list[dict]:
        """Run one request to its commit; returns its inference-log records (one per row).

        Whatever happens, the entry is released: committed, skipped, lost, or left (Redis
        away) for its lease to lapse and a live worker to reclaim it."""
        try:
            return await self._start_and_run(d)
        finally:
            self.consumer.release(d)

    async def _start_and_run(self, d: Delivery) -> list[dict]:
        rid = d.message.id
        if rid in self.running:  # another entry of a request running here: never run one twice
            log.warning("request %s is running here already: entry %s left alone", rid, d.entry_id)
            return []
        decision = await self.consumer.start(d)
        if decision != "run":
            log.info("request %s not run: %s", rid, decision)
            return []
        n_rows = len(d.message.rows)
        engine_ids = [rid] if n_rows == 1 else [f"{rid}:{i}" for i in range(n_rows)]
        run = Running(d, time.time(), engine_ids)
        self.running[rid] = run
        error: str | None = None
        try:
            # A redelivered request continues after the tokens its reply stream already holds:
            # what was streamed and the final text then agree by construction.
            resume = await delivered(self.redis, self.model.name, rid) if d.attempt > 1 else {}
            results = await asyncio.gather(*(self._generate_row(run, i, resume.get(i)) for i in range(n_rows)))
        except Exception as err:
            log.exception("request %s failed in the engine", rid)
            error, results = f"{type(err).__name__}: {err}", []
        finally:
            del self.running[rid]
        if run.lost:
            return []
        final = self._final(run, results, error)
        await self.replies.flush()
        if not await self.consumer.commit(d, final):
            return []
        metrics.observe_final(self.model.name, final)
        outputs = final.rows or ([final.output] if final.output else [])
        return [
            {"request_id": rid, "row": i, "status": final.status.value, "input": row,
             "output": outputs[i].record() if i < len(outputs) else None,
             "timings": final.timings.model_dump()}
            for i, row in enumerate(d.message.rows)
        ]

    async def _generate_row(self, run: Running, row: int, before: Delivered | None) -> RowOutput:
        msg = run.delivery.message
        values = msg.rows[row]
        s = msg.sampling
        before = before or Delivered()
        max_tokens = int(values.get("max_tokens") or s.max_tokens)
        result = RowResult(text=list(before.text), tokens=len(before.token_ids), finish_reason=before.finish)
        if result.finish_reason is None and result.tokens >= max_tokens:
            result.finish_reason = "length"
        if result.finish_reason is None:
            await self._stream_row(run, row, result, GenerationRequest(
                request_id=run.engine_ids[row],
                prompt=self.engine.prompt_for(values),
                max_tokens=max_tokens - result.tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                stop=s.stop,
                seed=s.seed + row,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                resume_token_ids=before.token_ids,
            ))
        text = "".join(result.text)
        extra = self.engine.extra_outputs(values, text, result.tokens)
        output = RowOutput(text=text, num_output_tokens=result.tokens, finish_reason=result.finish_reason,
                           fields=extra or None)
        run.prompt_tokens += result.prompt_tokens
        return output

    async def _stream_row(self, run: Running, row: int, result: RowResult, request: GenerationRequest) -> None:
        async for delta in self.engine.generate(request):
            if delta.prompt_tokens is not None:
                result.prompt_tokens = delta.prompt_tokens
            finish = delta.finish_reason if delta.finish_reason != "abort" else None
            if delta.token_ids or finish:
                if run.first_token is None and delta.token_ids:
                    run.first_token = time.time()
                self.replies.delta(run.delivery, DeltaEvent(
                    i=result.tokens, text=delta.text, token_ids=delta.token_ids,
                    attempt=run.delivery.attempt, row=row, finish=finish,
                ))
                result.text.append(delta.text)
                result.tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                result.finish_reason = delta.finish_reason

    def _final(self, run: Running, outputs: list[RowOutput], error: str | None) -> FinalResult:
        msg = run.delivery.message
        timings = Timings(enqueued=msg.enqueued_at, started=run.started,
                          first_token=run.first_token, finished=time.time())
        usage = Usage(prompt_tokens=run.prompt_tokens,
                      completion_tokens=sum(o.num_output_tokens for o in outputs))
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
            try:
                await asyncio.wait_for(self._closing.wait(), interval_s)
                return
            except TimeoutError:
                pass
            try:
                await duty()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("%s failed (%s: %s)", duty.__name__.strip("_"), type(err).__name__, err)

    def _sync_metrics(self) -> None:
        metrics.RUNNING.labels(self.model.name, self.name).set(len(self.running))
        reclaimed, dead = self.consumer.reclaimed, self.consumer.dead_lettered
        metrics.RECLAIMS.labels(self.model.name).inc(reclaimed - self._counted[0])
        metrics.DEAD_LETTERS.labels(self.model.name).inc(dead - self._counted[1])
        self._counted = (reclaimed, dead)

    async def _heartbeat(self) -> None:
        self._sync_metrics()
        await self.workers.beat(WorkerInfo(
            name=self.name, model=self.model.name, version=self.model.version,
            mode=self.model.mode.value, pid=os.getpid(), host=socket.gethostname(),
            in_flight=len(self.running), capacity=self.policy.capacity,
            started_at=self.started_at, heartbeat_at=0.0,
            state="draining" if self.stopping.is_set() else "running",
        ))
        await self.consumer.refresh_name(self.settings.worker_ttl_s)
        await self._check_version()

    async def _check_version(self) -> None:
        current = await self.models.get(self.model.name)
        if current is None or current.version == self.model.version or self._switch.is_set():
            return
        if current.framework_config != self.model.framework_config or current.path != self.model.path:
            log.warning("model %s v%d changes engine options: restart the worker to apply them",
                        current.name, current.version)
        log.info("model %s: v%d -> v%d (%s batching); switching after the current batches",
                 current.name, self.model.version, current.version, current.mode.value)
        self.model = current
        self._switch.set()

    async def _lease(self) -> None:
        """Keep every held entry this worker's, waiting in a batch or running."""
        for d in await self.consumer.lease_held():
            r = self.running.get(d.message.id)
            if r is not None and r.delivery.key == d.key and not r.lost:
                log.warning("request %s was reclaimed by another worker: aborting here", d.message.id)
                r.lost = True
                await self._abort(r)
            else:
                log.warning("request %s was reclaimed by another worker before it started here", d.message.id)

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
