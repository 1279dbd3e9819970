"""The webhook sender (`sluice webhooks send`): reads the outboxes through the consumer group
`senders` (N replicas share them), makes each event one delivery per endpoint that wants it, posts
each at once, retries failures with backoff and jitter until the retry period ends (then the
dead-letter list). All it holds is leased: a sender killed at any point loses nothing (its outbox
entries are reclaimed with XAUTOCLAIM, its deliveries come due again when their lease ends)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import httpx
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.keys import PREFIX, ModelKeys
from sluice.broker.plumbing import (
    StreamEntries,
    is_cluster,
    scored_members,
    stream_entries,
    streams_read,
    wait_for_copies,
)
from sluice.broker.registry import ModelRegistry
from sluice.broker.webhooks import outbox as webhooks
from sluice.broker.webhooks.breaker import BREAKER_FAILURES, Breakers
from sluice.broker.webhooks.deliveries import Deliveries, Delivery, event_id
from sluice.broker.webhooks.endpoints import Endpoint, EndpointStore
from sluice.config.settings import Settings
from sluice.protocol.openai_responses import response_id
from sluice.protocol.webhooks import UnsafeUrl, event_type, payload
from sluice.workers.webhooks import metrics
from sluice.workers.webhooks.post import post

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 6 * 3600.0
BUSY_RETRY_S = 0.5  # an endpoint at its concurrency limit: the delivery is due again this soon
COPY_TIMEOUT_MS = 1000  # with redis_wait_replicas: how long an outbox read waits for its replicas


class WebhookSender:
    def __init__(self, redis: Redis, settings: Settings, name: str, *, capacity: int = 256) -> None:
        self.redis = redis
        self.settings = settings
        self.name = name
        self.capacity = capacity  # deliveries in flight in this sender, all endpoints together
        self.deliveries = Deliveries(redis)
        self.endpoints = EndpointStore(redis)
        self.stopping = asyncio.Event()
        self.lease_s = max(settings.webhooks_lease_s, settings.webhooks_timeout_s + 1)  # outlasts an attempt
        self._inflight: set[asyncio.Task] = set()
        self._limits: dict[str, asyncio.Semaphore] = {}  # per endpoint: webhooks_concurrency
        self._waiting: dict[str, int] = {}  # per endpoint: deliveries waiting for a slot
        # Per endpoint, shared by every sender: a probe waits out its attempt's timeout.
        self.breakers = Breakers(redis, base_s=settings.webhooks_retry_base_s,
                                 probe_s=settings.webhooks_timeout_s + 1)
        self._known: tuple[float, dict[str, Endpoint]] = (float("-inf"), {})
        self._outboxes: tuple[float, list[str]] = (float("-inf"), [])
        self._grouped: set[str] = set()

    async def run(self) -> None:
        timeout = httpx.Timeout(self.settings.webhooks_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as self.client:
            loops = [asyncio.create_task(loop()) for loop in (self._read_outboxes, self._retry_due,
                                                               self._batches, self._reclaim, self._gauges)]
            await self.stopping.wait()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            if self._inflight:  # attempts under way end within their timeout; their leases keep the rest
                await asyncio.wait(self._inflight, timeout=self.settings.webhooks_timeout_s + 1)

    async def _forever(self, step, pause_s: float) -> None:
        while not self.stopping.is_set():
            try:
                if not await step():
                    await asyncio.sleep(pause_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away, say: the next turn tries again
                log.exception("webhook sender: %s failed; trying again", step.__name__)
                await asyncio.sleep(1.0)

    # -- the outboxes ---------------------------------------------------------------------------
    async def outboxes(self) -> list[str]:
        """Every deployed model's outbox on each of its shards (re-read every few seconds)."""
        at, streams = self._outboxes
        if time.monotonic() - at > 5.0:
            models = await ModelRegistry(self.redis).all()
            streams = [webhooks.outbox(k) for m in models for k in ModelKeys(m.name).shards(m.shards)]
            for stream in set(streams) - self._grouped:
                try:
                    await self.redis.xgroup_create(stream, webhooks.GROUP, id="0", mkstream=True)
                except ResponseError as err:
                    if "BUSYGROUP" not in str(err):
                        raise
                self._grouped.add(stream)
            self._outboxes = (time.monotonic(), streams)
        return streams

    async def _read_outboxes(self) -> None:
        async def step() -> bool:
            streams = await self.outboxes()
            if not streams or len(self._inflight) >= self.capacity:
                return False
            found: StreamEntries = []
            if is_cluster(self.redis):  # one slot per call
                for s in streams:
                    found += streams_read(await self.redis.xreadgroup(webhooks.GROUP, self.name, {s: ">"},
                                                                      count=100))
            else:
                found = streams_read(await self.redis.xreadgroup(
                    webhooks.GROUP, self.name, {s: ">" for s in streams}, count=100, block=200))
            for stream, entries in found:
                if not await self._copied(stream):
                    continue  # left pending: reclaimed once its lease lapses, and tried again
                for entry_id, fields in entries:
                    await self.fan_out(stream, entry_id, fields)
                    await self.redis.xack(stream, webhooks.GROUP, entry_id)
                    await self.redis.xdel(stream, entry_id)
            return bool(found)

        await self._forever(step, 0.05)

    async def _copied(self, stream: str) -> bool:
        """With redis_wait_replicas, whether the outbox entries just read are on the replicas (and
        so their finals, written by the same scripts before them): an event is sent only for a
        final no failover can take back (a final the primary alone held would be generated again,
        its event under another webhook-id), as a final is shown to its readers."""
        want = self.settings.redis_wait_replicas
        if not want:
            return True
        _, copies = await wait_for_copies(self.redis, stream, replicas=want, timeout_ms=COPY_TIMEOUT_MS)
        if copies < want:
            log.warning("outbox %s: its entries are on %d of %d replicas: not sent yet", stream, copies, want)
        return copies >= want

    async def _reclaim(self) -> None:
        """Entries a dead sender read and never acknowledged, idle past the lease: fanned out
        again (a delivery that exists already is left as it is)."""
        async def step() -> bool:
            for stream in await self.outboxes():
                _, entries, *_ = await self.redis.xautoclaim(stream, webhooks.GROUP, self.name,
                                                             int(self.lease_s * 1000), count=100)
                if entries and not await self._copied(stream):
                    continue
                for entry_id, fields in entries:
                    if fields:
                        await self.fan_out(stream, entry_id, fields)
                    await self.redis.xack(stream, webhooks.GROUP, entry_id)
                    await self.redis.xdel(stream, entry_id)
                for c in await self.redis.xinfo_consumers(stream, webhooks.GROUP):  # dead senders' names
                    if c["pending"] == 0 and c["idle"] > 600_000 and c["name"] != self.name:
                        await self.redis.xgroup_delconsumer(stream, webhooks.GROUP, c["name"])
            return False

        await self._forever(step, self.lease_s / 4)

    async def _batches(self) -> None:
        """Batches announced before a final move (broker/jobs/store.py): the event their script
        appended to their own outbox, if it did; an id without one, a minute old, is dropped."""
        async def step() -> bool:
            announced = scored_members(await self.redis.zrange(webhooks.BATCHES, 0, 99, withscores=True))
            for job_id, at in announced:
                stream = webhooks.batch_outbox(job_id)
                entries = stream_entries(await self.redis.xrange(stream))
                for entry_id, fields in entries:
                    await self.fan_out(stream, entry_id, fields, family="batch")
                if entries or time.time() - at > 60:
                    await self.redis.delete(stream)
                    await self.redis.zrem(webhooks.BATCHES, job_id)
            return False

        await self._forever(step, 0.5)

    async def fan_out(self, stream: str, entry_id: str, fields: dict[str, str],
                      family: str | None = None) -> None:
        rid, state = fields["id"], fields["state"]
        owner, model = fields.get("owner", ""), fields.get("model", "")
        if family is None:  # a request, or the request behind a Responses API response
            family, object_id, metadata = await self._request_or_response(model, rid)
        else:
            object_id, metadata = rid, await self._batch_metadata(rid)
        kind = event_type(family, state)
        wanted = [e for e in (await self.known()).values() if e.owner == owner and e.wants(kind)]
        if not wanted:
            return
        ev = event_id(stream, entry_id)
        extra: dict[str, object] = {"model": model} if model else {}
        if metadata:  # the client's own metadata, echoed (OpenAI's at most 16 short pairs)
            extra["metadata"] = metadata
        body = payload(ev, family, state, object_id, float(fields.get("at", time.time())), extra)
        created = await self.deliveries.enqueue([(e.id, ev, body) for e in wanted], self.lease_s)
        now = time.time()
        for d in created:
            endpoint = d.split(":delivery:", 1)[1].split(":", 1)[0]
            self._spawn(Delivery(d, endpoint, ev, body, 0, now))

    async def _request_or_response(self, model: str, rid: str) -> tuple[str, str, dict | None]:
        """(family, the id the event names, metadata): a request made through /v1/responses has
        its response's record (saved before its admission, kept as long as its result), and its
        event names the response (`resp_...`) with the client's metadata; a plain request has
        neither."""
        raw = await self.redis.get(ModelKeys(model).response(rid)) if model else None
        if raw is None:
            return "request", rid, None
        return "response", response_id(rid), (json.loads(raw) or {}).get("metadata")

    async def _batch_metadata(self, job_id: str) -> dict | None:
        raw = await self.redis.hget(f"{PREFIX}:batch:{job_id}", "metadata")
        return json.loads(raw) if raw else None

    # -- deliveries -----------------------------------------------------------------------------
    async def known(self) -> dict[str, Endpoint]:
        at, endpoints = self._known
        if time.monotonic() - at > 2.0:
            endpoints = {e.id: e for e in await self.endpoints.list()}
            self._known = (time.monotonic(), endpoints)
        return endpoints

    async def _retry_due(self) -> None:
        async def step() -> bool:
            room = self.capacity - len(self._inflight)
            if room <= 0:
                return False
            due = await self.deliveries.claim(min(room, 100), self.lease_s)
            for d in due:
                self._spawn(d)
            return bool(due)

        await self._forever(step, 0.1)

    def _spawn(self, d: Delivery) -> None:
        task = asyncio.create_task(self.attempt(d))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def attempt(self, d: Delivery) -> None:
        endpoint = (await self.known()).get(d.endpoint) or await self.endpoints.get(d.endpoint)
        if endpoint is None:  # deleted: nobody to tell
            await self.deliveries.settle(d, "ok", counted="dropped")
            metrics.DELIVERIES.labels(d.endpoint, "dropped").inc()
            return
        if not endpoint.enabled:  # disabled: later, no attempt counted (its retry period still runs)
            await self.deliveries.settle(d, "later", next_at=time.time() + 60 * random.uniform(1, 2))
            return
        verdict = await self.breakers.check(endpoint.id)
        if not verdict.go:  # its circuit is open: later, no attempt counted (a probe goes first)
            await self.deliveries.settle(d, "later", next_at=verdict.until + random.uniform(0, 1))
            return
        if not await self._slot(endpoint.id):  # at its concurrency limit for long: later, no attempt counted
            await self.deliveries.settle(d, "later",
                                         next_at=time.time() + BUSY_RETRY_S * random.uniform(1, 2))
            return
        try:
            delivered, what = await post(self.client, endpoint, d.event_id, d.body,
                                         allow_private=self.settings.webhooks_allow_private,
                                         timeout_s=self.settings.webhooks_timeout_s)
        except UnsafeUrl as err:
            delivered, what = False, str(err)
        finally:
            self._limits[endpoint.id].release()
        if await self.breakers.record(endpoint.id, delivered, verdict.probe) == BREAKER_FAILURES:
            log.warning("webhook endpoint %s failed %d times in a row: its circuit is open", endpoint.id,
                        BREAKER_FAILURES)
        if delivered:
            await self.deliveries.settle(d, "ok")
            metrics.DELIVERIES.labels(endpoint.id, "delivered").inc()
            return
        delay = backoff(d.attempts + 1, self.settings.webhooks_retry_base_s)
        if time.time() + delay > d.first_at + self.settings.webhooks_retry_period_s:
            await self.deliveries.settle(d, "dead", error=what)
            metrics.DELIVERIES.labels(endpoint.id, "dead").inc()
            log.warning("webhook %s to %s: dead after %d attempts (%s)", d.event_id, endpoint.id,
                        d.attempts + 1, what)
        else:
            await self.deliveries.settle(d, "retry", next_at=time.time() + delay, error=what)
            metrics.DELIVERIES.labels(endpoint.id, "retried").inc()

    async def _slot(self, endpoint_id: str) -> bool:
        """One of the endpoint's `webhooks_concurrency` slots, waited for while the delivery's lease
        leaves time for the attempt; False (nothing taken) past that, or when as many deliveries
        as 4 slots' worth wait already: a slow endpoint holds a bounded share of this sender."""
        limit = self._limits.setdefault(endpoint_id, asyncio.Semaphore(self.settings.webhooks_concurrency))
        if self._waiting.get(endpoint_id, 0) >= 4 * self.settings.webhooks_concurrency:
            return False
        self._waiting[endpoint_id] = self._waiting.get(endpoint_id, 0) + 1
        try:
            await asyncio.wait_for(limit.acquire(),
                                   max(self.lease_s - self.settings.webhooks_timeout_s - 1, 0.2))
            return True
        except TimeoutError:
            return False
        finally:
            self._waiting[endpoint_id] -= 1

    async def _gauges(self) -> None:
        async def step() -> bool:
            count, oldest = await self.deliveries.backlog()
            metrics.BACKLOG.set(count)
            metrics.OLDEST.set(oldest)
            return False

        await self._forever(step, 5.0)


def backoff(attempt: int, base_s: float) -> float:
    """Exponential, with full jitter over its upper half: base x 2^(attempt-1), capped at 6 h."""
    ceiling = min(base_s * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S)
    return random.uniform(ceiling / 2, ceiling)
