"""DeadLetters on a private Redis: list what failed, retry it onto its own lane within the bound
(status queued again, old replies cleared), leave an unreadable letter for drop, and drop."""

from __future__ import annotations

import json
import time

from redis.asyncio import Redis

from sluice.broker.delivery.calls import Requeue
from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.plumbing import ScriptCall
from sluice.config.settings import Settings
from sluice.protocol.messages import RequestMessage
from tests.broker.helpers import KEYS, MODEL, admission, fetch_one, message, ready_consumer, statuses


async def bury(redis: Redis, m: RequestMessage | None, *, stream: str = KEYS.requests, rid: str = "",
               data: str | None = None) -> str:
    """A dead letter as the consumer writes one (broker/lua/dead_letter.lua)."""
    fields = {"id": m.id if m else rid, "data": data if data is not None else m.model_dump_json(),  # type: ignore[union-attr]
              "error": "engine died", "attempts": 3, "failed_at": time.time(), "stream": stream}
    return await redis.xadd(KEYS.dead_letters, fields)


async def test_list_reads_each_letter_and_keeps_an_unreadable_one_raw(redis: Redis) -> None:
    m = message()
    await bury(redis, m)
    await bury(redis, None, rid="req-garbled", data="{not json")
    good, bad = await DeadLetters(redis, MODEL).list()
    assert (good.request_id, good.error, good.attempts, good.stream) == (m.id, "engine died", 3, KEYS.requests)
    assert good.message is not None and good.message.id == m.id
    assert bad.message is None and bad.data == "{not json" and bad.request_id == "req-garbled"


async def test_retry_requeues_on_its_lane_with_a_fresh_deadline_and_clears_its_replies(redis: Redis) -> None:
    interactive, bulk = message(deadline_in=60), message(lane="bulk")
    await bury(redis, interactive)
    await bury(redis, bulk, stream=KEYS.bulk)
    await redis.xadd(KEYS.reply(interactive.id), {"kind": "delta", "data": "{}"})
    await redis.hset(KEYS.status(interactive.id), mapping={"state": "failed", "result": "{}", "attempt": 3})
    before = time.time()
    retried = await DeadLetters(redis, MODEL).retry(None, max_queued=10)
    assert sorted(retried) == sorted([interactive.id, bulk.id])
    assert await redis.xlen(KEYS.dead_letters) == 0
    assert await redis.xlen(KEYS.requests) == 1 and await redis.xlen(KEYS.bulk) == 1
    ((_, fields),) = await redis.xrange(KEYS.requests)
    again = RequestMessage.model_validate_json(fields["data"])
    assert again.enqueued_at >= before and abs((again.deadline - again.enqueued_at) - 60) < 1e-6
    status = await redis.hgetall(KEYS.status(interactive.id))
    assert status["state"] == "queued" and "result" not in status and "attempt" not in status
    assert await redis.exists(KEYS.reply(interactive.id)) == 0
    assert await redis.ttl(KEYS.status(interactive.id)) > 0


async def test_retry_stays_within_the_bound_and_leaves_the_rest_buried(redis: Redis) -> None:
    letters = [message() for _ in range(3)]
    for m in letters:
        await bury(redis, m)
    retried = await DeadLetters(redis, MODEL).retry(None, max_queued=2)
    assert retried == [letters[0].id, letters[1].id]
    assert [d.request_id for d in await DeadLetters(redis, MODEL).list()] == [letters[2].id]


async def test_retry_and_drop_take_only_the_named_requests(redis: Redis) -> None:
    a, b = message(), message()
    await bury(redis, a)
    await bury(redis, b)
    await bury(redis, None, rid="req-garbled", data=json.dumps({"id": "req-garbled"}))
    letters = DeadLetters(redis, MODEL)
    assert await letters.retry([b.id, "req-garbled", "req-unknown"], max_queued=10) == [b.id]
    assert sorted(d.request_id for d in await letters.list()) == sorted([a.id, "req-garbled"])
    assert await letters.drop(["req-garbled"]) == ["req-garbled"]
    assert await letters.drop(["req-unknown"]) == []
    assert [d.request_id for d in await letters.list()] == [a.id]
    assert await letters.drop(None) == [a.id]
    assert await redis.xlen(KEYS.dead_letters) == 0


# -- issue 28, defects 8 and 9 ------------------------------------------------------------------


async def _dead_lettered_with_an_owner(redis: Redis, settings: Settings) -> RequestMessage:
    """A request with an owner, admitted with its model's retention, run, and dead-lettered."""
    m = message().model_copy(update={"owner": "sha256:abc"})
    await admission(redis, settings).submit(m, max_queued=10, result_ttl_s=777)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    assert await c.dead_letter(d.stream, d.entry_id, m.id, m.model_dump_json(), "crashed", 3, m)
    return m


def _whole(status: dict[str, str]) -> tuple:
    return (status.get("owner"), status.get("model"), status.get("lane"), status.get("retain_s"))


async def test_a_retry_after_the_result_expired_gives_the_status_back_whole(
        redis: Redis, settings: Settings) -> None:
    """Defect 8: `dlq retry` after the failed result's retention re-created the status without
    owner, retention, model or lane (with keys on, its owner then got 404 for it forever)."""
    m = await _dead_lettered_with_an_owner(redis, settings)
    await redis.delete(KEYS.status(m.id))  # the failed result's retention passed
    assert await DeadLetters(redis, MODEL, result_ttl_s=555).retry(None, max_queued=10) == [m.id]
    status = await redis.hgetall(KEYS.status(m.id))
    assert status["state"] == "queued"
    assert _whole(status) == ("sha256:abc", MODEL, "interactive", "555")
    assert (await statuses(redis, settings).status(MODEL, m.id)).owner == "sha256:abc"


async def test_a_retry_keeps_the_retention_the_request_was_admitted_with(redis: Redis, settings: Settings) -> None:
    m = await _dead_lettered_with_an_owner(redis, settings)
    assert await DeadLetters(redis, MODEL, result_ttl_s=555).retry(None, max_queued=10) == [m.id]
    assert _whole(await redis.hgetall(KEYS.status(m.id))) == ("sha256:abc", MODEL, "interactive", "777")


async def test_a_dead_letter_whose_status_expired_fails_with_its_status_whole(
        redis: Redis, settings: Settings) -> None:
    """Defect 8, dead_letter.lua's "status expired" branch: the failed final's status had no
    owner, model, lane or age."""
    m = message().model_copy(update={"owner": "sha256:abc", "lane": "bulk"})
    await admission(redis, settings).submit(m, max_queued=10)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    await redis.delete(KEYS.status(m.id))
    assert await c.dead_letter(d.stream, d.entry_id, m.id, m.model_dump_json(), "crashed", 3, m)
    status = await redis.hgetall(KEYS.status(m.id))
    assert (status["state"], status["owner"], status["model"], status["lane"]) == ("failed", "sha256:abc", MODEL,
                                                                                     "bulk")
    assert float(status["enqueued_at"]) == m.enqueued_at and await redis.ttl(KEYS.status(m.id)) > 0


async def test_a_dead_letter_is_retried_once_even_from_a_stale_listing(redis: Redis, settings: Settings) -> None:
    """Defect 9: two `dlq retry` of one dead letter (the second from a listing taken before the
    first ran) put two entries on the stream for it: requeue.lua ignored whether the dead letter
    still existed. Now the second finds it gone and puts nothing on the stream."""
    m = await _dead_lettered_with_an_owner(redis, settings)
    letters = DeadLetters(redis, MODEL)
    stale = await letters.list()

    async def listed(_ids):
        return stale

    assert await letters.retry(None, max_queued=10) == [m.id]
    letters._select = listed  # type: ignore[method-assign]
    assert await letters.retry(None, max_queued=10) == []
    assert await redis.xlen(KEYS.requests) == 1
    entry = await redis.hget(KEYS.status(m.id), "entry")
    assert [e for e, _ in await redis.xrange(KEYS.requests)] == [entry]


async def test_a_retry_whose_answer_was_lost_and_re_sent_reports_the_letter_retried(
        redis: Redis, settings: Settings) -> None:
    """requeue.lua's answer lost and the call re-sent as it was (redis-py retries a call whose
    connection broke): the re-run found the letter gone and `dlq retry` reported it "gone"
    though the first run had requeued it. Now the re-run answers the entry it put on the
    stream; nothing is put there twice, and another call (a stale listing) still finds it gone."""
    m = await _dead_lettered_with_an_owner(redis, settings)
    letters = DeadLetters(redis, MODEL)
    stale = await letters.list()
    scripts = letters.scripts
    answers = []

    async def answer_lost(call: ScriptCall):
        assert isinstance(call, Requeue)
        answers.append(await scripts(call))  # ran; its answer never came back
        return await scripts(call)  # the same call, sent again

    letters.scripts = answer_lost
    assert await letters.retry(None, max_queued=10) == [m.id]
    entry = await redis.hget(KEYS.status(m.id), "entry")
    assert answers == [entry] and [e for e, _ in await redis.xrange(KEYS.requests)] == [entry]

    async def listed(_ids):
        return stale

    letters.scripts = scripts
    letters._select = listed  # type: ignore[method-assign]
    assert await letters.retry(None, max_queued=10) == []  # another call: gone
    assert await redis.xlen(KEYS.requests) == 1
