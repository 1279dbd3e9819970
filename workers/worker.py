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

from redis.asyncio import Redis

from sluice.batching.base import BatchingPolicy
from sluice.batching.registry import make_policy
from sluice.broker.delivery.affinity import PlacementRules
from sluice.broker.delivery.consumer import Delivery, StreamConsumer
from sluice.broker.delivery.fair_share import SlotReserves
from sluice.broker.delivery.lanes import shards_in_use
from sluice.broker.inference_log import LogBuffer
from sluice.broker.limits import ConsumerLimits
from sluice.broker.plumbing.connection import until_redis_answers
from sluice.broker.registry import ModelRegistry, WorkerInfo, WorkerRegistry
from sluice.broker.replies.writer import ReplyWriter, delivered, heard_cancel
from sluice.config.model import ModelConfig
from sluice.config.runtime import freeze_gc_heap
from sluice.config.settings import Settings
from sluice.protocol.messages import RowOutput
from sluice.protocol.states import State
from sluice.workers import metrics
from sluice.workers.engines.base import Engine
from sluice.workers.generation import Generation, Running, final_result, log_records
from sluice.workers.pace import Pace, expected_tokens

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, settings: Settings, model: ModelConfig, engine: Engine, redis: Redis, name: str, *,
                 metrics_url: str | None = None, freeze_gc: bool = False):
        """`freeze_gc`: the process is this worker's own, and its start-up heap is frozen once
        the engine has started (config/runtime.py)."""
        self.settings = settings
        self.freeze_gc = freeze_gc
        self.metrics_url = metrics_url
        self.model = model
        self.engine = engine
        self.redis = redis
        self.name = name
        self.consumer = StreamConsumer(redis, model.name, name, ConsumerLimits.of(settings, model))
        # An unfinished request's reply stream lives as long as its status (a retry resumes from it).
        self.replies = ReplyWriter(redis, model.name, reply_ttl_s=settings.status_ttl_s,
                                   on_call=metrics.REPLY_CALLS.labels(model.name).inc)
        self.inference_log = LogBuffer(self.consumer.append_log)
        self.generation = Generation(engine, self.replies,
                                     lambda gap: self.pace.token_gap(gap, len(self.running)))
        self.workers = WorkerRegistry(redis)
        self.models = ModelRegistry(redis)
        self.policy = self._policy(model)
        self.running: dict[str, Running] = {}
        self.stopping = asyncio.Event()
        self.started_at, self._batches = time.time(), 0
        # a policy's end; the background duties' end
        self._switch, self._closing = asyncio.Event(), asyncio.Event()
        # the consumer's reclaims and dead letters already in the metrics; when the next heartbeat is due
        self._counted, self._next_beat = (0, 0), 0.0
        self._prefix_cache = metrics.PrefixCacheExport()
        self._background: list[asyncio.Task] = []

    async def _read_shards(self) -> None:
        """Read the model's shards, and those a smaller `shards` left with entries (they drain)."""
        self.consumer.configure(shards=await shards_in_use(self.redis, self.consumer.keys, self.model.shards))
        await self.consumer.ensure_groups()

    def _policy(self, model: ModelConfig) -> BatchingPolicy:
        """The batching policy of `model`; the consumer reads for it (the slots its reads keep
        free, placing by prefix where the deployment asks for it)."""
        policy = make_policy(model)
        self.consumer.configure(reserves=SlotReserves.of(self.settings, policy.capacity),
                                placement=PlacementRules.of(self.settings, model))
        self.pace = Pace(model, policy, self.name)
        self.serving = model  # what its heartbeat says it runs: a new version only once its policy does
        return policy

    # -- the Source the batching policy pulls from
    async def fetch(self, count: int, timeout_s: float, quarantine_room: int = 1) -> list[Delivery]:
        try:
            return await self.consumer.fetch(count, int(timeout_s * 1000), quarantine_room=quarantine_room)
        except Exception as err:
            # Redis away: say so, wait, and try again (the consumer re-creates a lost consumer group)
            log.warning("fetching from Redis failed (%s: %s); retrying", type(err).__name__, err)
            await asyncio.sleep(min(timeout_s, 1.0))
            return []

    async def run(self) -> None:
        self.name = await until_redis_answers(lambda: self.consumer.claim_name(self.settings.worker_ttl_s))
        await until_redis_answers(self._read_shards)
        await self.engine.start()
        if self.freeze_gc:
            freeze_gc_heap()
        self.replies.start()
        self._background = [
            asyncio.create_task(self._every(min(self.settings.heartbeat_interval_s, 0.25), self._heartbeat),
                                name="heartbeat"),
            asyncio.create_task(self._every(self.settings.lease_timeout_s / 3, self._lease), name="lease"),
            asyncio.create_task(self._every(self.settings.cancel_poll_s, self._watch), name="watch"),
            asyncio.create_task(self._every(6 * self.settings.worker_ttl_s, self.consumer.prune_consumers),
                                name="prune"),
            asyncio.create_task(self._every(0.1, self.inference_log.flush), name="log"),
            asyncio.create_task(self._forward_stop(), name="stop"),
        ]
        await until_redis_answers(self._heartbeat)  # (a failover met here ended the process once)
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
                self.policy = self._policy(self.model)
                await self._read_shards()
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
            await self.inference_log.flush()
            await self.workers.remove(self.name)
            await self.consumer.affinity.stop(self.name)
            await self.consumer.release_name()
            await self.engine.shutdown()

    async def _forward_stop(self) -> None:
        stop = asyncio.ensure_future(self.stopping.wait())
        closing = asyncio.ensure_future(self._closing.wait())
        await asyncio.wait([stop, closing], return_when=asyncio.FIRST_COMPLETED)
        self._switch.set()

    async def _drain(self) -> None:
        log.info("worker %s stops fetching; draining %d running request(s)", self.name, len(self.running))
        await self._heartbeat()
        if await self.policy.drain(self.settings.shutdown_timeout_s):
            log.warning("%d request(s) still running after %.0fs: left to be reclaimed",
                        len(self.running), self.settings.shutdown_timeout_s)
            for r in list(self.running.values()):
                r.fenced = True
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
        self.inference_log.add(records)  # written by the "log" duty

    async def _run_request(self, d: Delivery) -> list[dict]:
        """Run one request to its commit; returns its inference-log records (one per row). Whatever
        happens, the entry is released: committed, skipped, fenced, or left (Redis away) for its
        lease to lapse and a live worker to reclaim it."""
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
        run = Running.start(d)
        self.running[rid] = run
        error: str | None = None
        outputs: list[RowOutput] = []
        try:
            resume = await delivered(self.redis, self.model.name, rid) if d.attempt > 1 else {}
            outputs = await self.generation.rows(run, resume)
        except Exception as err:
            log.exception("request %s failed in the engine", rid)
            error = f"{type(err).__name__}: {err}"
        finally:
            del self.running[rid]
        if run.fenced:
            return []
        final = final_result(run, outputs, error)
        if not await self.replies.commit(d, final, self.consumer.commit):
            return []
        metrics.observe_final(self.model.name, final, d.message.tenant)
        self.pace.finished(final)
        return log_records(d, final)

    # -- background duties
    async def _every(self, interval_s: float, duty) -> None:
        while True:
            try:
                async with asyncio.timeout(interval_s):  # (wait_for would make a task each time)
                    await self._closing.wait()
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
        self._prefix_cache.sync(self.model.name, self.name, self.engine.prefix_cache_counters())

    async def _heartbeat(self) -> None:
        if time.monotonic() < self._next_beat and self.pace.admitted > 0.75 * self.pace.told:
            return  # not due, and no fall of the limit that the api's TTFT bound must hear of at once
        self._next_beat = time.monotonic() + self.settings.heartbeat_interval_s
        self.pace.told = self.pace.admitted
        self._sync_metrics()
        await self.workers.beat(WorkerInfo(
            name=self.name, model=self.model.name, version=self.serving.version,
            mode=self.serving.mode.value, pid=os.getpid(), host=socket.gethostname(),
            in_flight=len(self.running), capacity=self.policy.capacity,
            started_at=self.started_at, heartbeat_at=0.0,
            state="draining" if self.stopping.is_set() else "running", metrics_url=self.metrics_url,
            admitted=self.pace.admitted,
            service_rate=round(self.pace.service_rate(expected_tokens(self.running.values())), 3),
            **self._prefix_cache.heartbeat(self.engine.prefix_cache_counters()),
        ))
        await self.consumer.refresh_name(self.settings.worker_ttl_s)
        await self.consumer.affinity.heartbeat(self.name, self.policy.capacity - len(self.running))
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
            if r is not None and r.delivery.key == d.key and not r.fenced:
                log.warning("request %s was reclaimed by another worker: aborting here", d.message.id)
                r.fenced = True
                await self._abort(r)
            else:
                log.warning("request %s was reclaimed by another worker before it started here", d.message.id)

    async def _watch(self) -> None:
        runs = {rid: r for rid, r in self.running.items() if r.stop_reason is None and not r.fenced}
        if not runs:
            return
        now, fresh_after = time.time(), time.monotonic() - self.settings.cancel_poll_s  # (see heard_cancel)
        heard, unheard = heard_cancel({rid: r.delivery for rid, r in runs.items()}, fresh_after)
        for rid in heard | await self.consumer.cancelled(unheard):
            runs[rid].stop_reason = State.CANCELLED
            await self._abort(runs[rid])
        for r in runs.values():
            if r.stop_reason is None and now > r.delivery.message.deadline:
                r.stop_reason = State.EXPIRED
                await self._abort(r)

    async def _abort(self, run: Running) -> None:
        await self.generation.abort(run)
