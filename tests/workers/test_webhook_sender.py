"""The webhook sender (workers/webhooks/sender.py) against a real receiver on loopback: every final
of a subscribed owner's requests arrives, signed (verified with `standardwebhooks`; a wrong secret
fails); a failed attempt is retried under the same webhook-id; past the retry period a delivery
is dead, and a replay delivers it; redirects are not followed; private addresses are refused
unless allowed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis
from standardwebhooks.webhooks import WebhookVerificationError

from sluice.broker.jobs.store import JobStore
from sluice.broker.registry import ModelRegistry
from sluice.broker.webhooks import outbox as webhooks
from sluice.broker.webhooks.breaker import BREAKER_TTL_S, breaker
from sluice.broker.webhooks.deliveries import Deliveries
from sluice.broker.webhooks.endpoints import EndpointStore
from sluice.broker.webhooks.outbox import DUE
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.openai_responses import response_id
from sluice.protocol.webhooks import probe_payload
from sluice.workers.webhooks.sender import WebhookSender
from tests.broker.helpers import KEYS, MODEL, admission, cancels, done_result, message, ready_consumer
from tests.workers.webhook_receiver import Receiver

FAST = {"webhooks_allow_private": True, "webhooks_retry_base_s": 0.05, "webhooks_timeout_s": 2.0,
        "webhooks_lease_s": 3.0}


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    return settings.model_copy(update=FAST)


@asynccontextmanager
async def sender_and_receiver(redis: Redis, settings: Settings, answer=None,
                              delay_s: float = 0.0) -> AsyncIterator[Receiver]:
    await ModelRegistry(redis).deploy(ModelConfig(name=MODEL))
    receiver = await Receiver(**({"answer": answer} if answer else {}), delay_s=delay_s).start()
    sender = WebhookSender(redis, settings, "sender-1")
    task = asyncio.create_task(sender.run())
    try:
        yield receiver
    finally:
        sender.stopping.set()
        await asyncio.wait_for(task, 15)
        await receiver.stop()


async def until(check: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def finish(redis: Redis, settings: Settings, n: int, *, owner: str | None = None) -> list[str]:
    """`n` requests of `owner` run to `done`, one more cancelled while queued; their ids."""
    adm = admission(redis, settings)
    done = []
    for _ in range(n):
        m = message().model_copy(update={"owner": owner})
        await adm.submit(m, max_queued=1000)
        done.append(m.id)
    c = await ready_consumer(redis, settings)
    for d in await c.fetch(n, 1000):
        assert await c.start(d) == "run" and await c.commit(d, done_result()) is True
    cancelled = message().model_copy(update={"owner": owner})
    await adm.submit(cancelled, max_queued=1000)
    assert await cancels(redis, settings).cancel(KEYS.model, cancelled.id) == "cancelled"
    return [*done, cancelled.id]


async def test_every_final_arrives_signed_once(redis: Redis, hook_settings: Settings) -> None:
    store = EndpointStore(redis)
    async with sender_and_receiver(redis, hook_settings) as receiver:
        endpoint = await store.create(receiver.url, [], owner="")
        only_cancels = await store.create(receiver.url, ["request.cancelled"], owner="")
        other_owner = await store.create(receiver.url, [], owner="ab" * 32)
        rids = await finish(redis, hook_settings, 5)
        await until(lambda: len(receiver.got) == 7)  # 6 finals to the first, the cancel to the second
        await asyncio.sleep(0.3)
    assert len(receiver.got) == 7
    events = {}
    for got in receiver.got:
        try:
            event = got.verify(endpoint.secret)
        except WebhookVerificationError:
            event = got.verify(only_cancels.secret)
            assert event["type"] == "request.cancelled"
            continue
        assert got.headers["webhook-id"] == event["id"] and got.headers["content-type"] == "application/json"
        events[event["data"]["id"]] = event
        with pytest.raises(WebhookVerificationError):
            got.verify(other_owner.secret)  # a wrong secret fails
    assert set(events) == set(rids)
    assert [events[r]["type"] for r in rids] == ["request.completed"] * 5 + ["request.cancelled"]
    assert all(e["data"]["model"] == MODEL and e["data"]["status"] in ("done", "cancelled") for e in events.values())
    assert await redis.zcard(DUE) == 0


async def test_a_failed_attempt_is_retried_under_the_same_webhook_id(redis: Redis, hook_settings: Settings) -> None:
    async with sender_and_receiver(redis, hook_settings, answer=lambda got, first: 500 if first else 200) as rec:
        endpoint = await EndpointStore(redis).create(rec.url, [], owner="")
        rids = await finish(redis, hook_settings, 3)
        await until(lambda: len(rec.got) == 8)
        await asyncio.sleep(0.3)  # nothing more comes
    ids = rec.by_id()
    assert len(ids) == 4 and all(len(tries) == 2 for tries in ids.values())
    assert {tries[0].verify(endpoint.secret)["data"]["id"] for tries in ids.values()} == set(rids)
    assert all(tries[0].body == tries[1].body for tries in ids.values())


async def test_past_its_retry_period_a_delivery_is_dead_and_a_replay_delivers_it(redis: Redis,
                                                                                hook_settings: Settings) -> None:
    answers = {"status": 500}
    s = hook_settings.model_copy(update={"webhooks_retry_period_s": 0.3})
    async with sender_and_receiver(redis, s, answer=lambda got, first: answers["status"]) as rec:
        await EndpointStore(redis).create(rec.url, [], owner="")
        await finish(redis, s, 1)
        deliveries = Deliveries(redis)
        await until(lambda: len(rec.by_id()) == 2)
        await until_async(lambda: deliveries.dead(), 2)
        (letter, _) = await deliveries.dead()
        assert letter["error"] == "HTTP 500" and int(letter["attempts"]) >= 1
        answers["status"] = 200
        assert await deliveries.replay() == 2
        await until_async(lambda: redis.zcard(DUE), 0)
    assert await deliveries.dead() == []
    assert all(len(tries) >= 2 for tries in rec.by_id().values())  # failed, then delivered once replayed


async def until_async(read, want, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await read()
        if (len(got) if isinstance(got, list) else got) == want:
            return
        assert time.monotonic() < deadline, f"timed out: {got}"
        await asyncio.sleep(0.05)


async def test_redirects_are_not_followed_and_private_addresses_are_refused(redis: Redis,
                                                                          hook_settings: Settings) -> None:
    s = hook_settings.model_copy(update={"webhooks_retry_period_s": 0.2})
    async with sender_and_receiver(redis, s, answer=lambda got, first: 307) as rec:
        await EndpointStore(redis).create(rec.url, [], owner="")
        await finish(redis, s, 1)
        await until_async(lambda: Deliveries(redis).dead(), 2)
    assert {d["error"] for d in await Deliveries(redis).dead()} == {"HTTP 307"}
    assert all(r.headers.get("host", "").startswith("127.0.0.1") for r in rec.got)
    await redis.delete("sluice:{webhooks}:dead")
    private = s.model_copy(update={"webhooks_allow_private": False})
    async with sender_and_receiver(redis, private) as rec:
        await finish(redis, private, 1)
        await until_async(lambda: Deliveries(redis).dead(), 2)
    assert rec.got == []
    assert all("SLUICE_WEBHOOKS_ALLOW_PRIVATE" in d["error"] for d in await Deliveries(redis).dead())


async def test_during_a_rotation_both_secrets_verify(redis: Redis, hook_settings: Settings) -> None:
    store = EndpointStore(redis)
    async with sender_and_receiver(redis, hook_settings) as rec:
        old = await store.create(rec.url, [], owner="")
        new = await store.rotate(old.id)
        await finish(redis, hook_settings, 1)
        await until(lambda: len(rec.got) == 2)
    for got in rec.got:
        assert got.verify(old.secret) == got.verify(new.secret)
        assert len(got.headers["webhook-signature"].split(" ")) == 2


async def test_an_endpoint_gets_at_most_its_concurrency_at_once(redis: Redis, hook_settings: Settings) -> None:
    s = hook_settings.model_copy(update={"webhooks_concurrency": 2})
    async with sender_and_receiver(redis, s, delay_s=0.1) as rec:
        await EndpointStore(redis).create(rec.url, [], owner="")
        rids = await finish(redis, s, 11)
        await until(lambda: len(rec.got) == len(rids))
    assert rec.max_in_flight == 2


async def test_a_failing_endpoint_opens_its_circuit_and_holds_up_no_other(redis: Redis,
                                                                        hook_settings: Settings) -> None:
    s = hook_settings.model_copy(update={"webhooks_retry_base_s": 30.0})
    failing = await Receiver(answer=lambda got, first: 503).start()
    try:
        async with sender_and_receiver(redis, s) as healthy:
            bad = await EndpointStore(redis).create(failing.url, [], owner="")
            await EndpointStore(redis).create(healthy.url, [], owner="")
            rids = await finish(redis, s, 9)
            await until(lambda: len(healthy.got) == len(rids) and len(failing.got) >= 5)
        # Two senders share the endpoint's circuit (Redis): failures seen by either count together.
        one, two = WebhookSender(redis, s, "breaker-1").breakers, WebhookSender(redis, s, "breaker-2").breakers
        await redis.delete(breaker(bad.id))
        for b in (one, two, one, two):
            assert await b.record(bad.id, False) > 0
        assert (await two.check(bad.id)).go  # 4 failures in a row: still closed
        assert await one.record(bad.id, False) == 5
        shut = await two.check(bad.id)
        assert not shut.go and shut.until > time.time() + 20  # open, for the other sender too
        assert await two.record(bad.id, False) == 0  # begun before it opened: the wait is not stretched
        assert (await one.check(bad.id)).until == shut.until
        await redis.hset(breaker(bad.id), "open_until", time.time() - 1)  # its wait is over
        probe = await one.check(bad.id)
        assert probe.go and probe.probe
        waits = await two.check(bad.id)  # one probe across the senders: the other waits for it
        assert not waits.go and waits.until >= time.time() + s.webhooks_timeout_s
        assert await one.record(bad.id, False, was_probe=True) == 6  # the probe failed: open twice as long
        assert (await two.check(bad.id)).until > time.time() + 50
        assert 0 < await redis.ttl(breaker(bad.id)) <= BREAKER_TTL_S  # a forgotten endpoint's breaker goes
        await two.record(bad.id, True)
        assert (await one.check(bad.id)).go and not await redis.exists(breaker(bad.id))  # a success closes it
    finally:
        await failing.stop()


async def test_responses_batches_and_test_events_have_their_types(redis: Redis, hook_settings: Settings) -> None:
    async with sender_and_receiver(redis, hook_settings) as rec:
        endpoint = await EndpointStore(redis).create(rec.url, [], owner="")
        adm = admission(redis, hook_settings)
        # A /v1/responses request: a plain request id, and its response's record saved before it
        response = message()
        await redis.set(KEYS.response(response.id), json.dumps({"metadata": {"order": "42"}}), ex=60)
        await adm.submit(response, max_queued=1000)
        assert await cancels(redis, hook_settings).cancel(KEYS.model, response.id) == "cancelled"
        jobs = JobStore(redis)
        batch = await jobs.create("file-x", "/v1/completions", "24h", {"team": "a"}, owner="")
        assert await jobs.move(batch["id"], "in_progress", ["validating"]) == "in_progress"
        assert await jobs.move(batch["id"], "completed", ["in_progress"]) == "completed"
        await Deliveries(redis).enqueue([(endpoint.id, "msg_test", probe_payload("msg_test"))], lease_s=0)
        await until(lambda: len(rec.got) == 3)
    events = {e["type"]: e for e in (got.verify(endpoint.secret) for got in rec.got)}
    assert set(events) == {"response.cancelled", "batch.completed", "webhook.test"}
    assert events["response.cancelled"]["data"]["id"] == response_id(response.id)  # the response, as OpenAI's
    assert events["response.cancelled"]["data"]["metadata"] == {"order": "42"}  # the client's, echoed
    assert events["batch.completed"]["data"]["id"] == batch["id"]
    assert events["batch.completed"]["data"]["metadata"] == {"team": "a"}
    assert await redis.zcard(webhooks.BATCHES) == 0 and not await redis.exists(webhooks.batch_outbox(batch["id"]))
