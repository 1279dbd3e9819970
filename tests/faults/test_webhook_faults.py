"""Webhooks under faults: the sender process is SIGKILLed again and again while 1,000 requests
reach their finals (done, cancelled, dead-lettered) and the receiver answers 500 to a random third
of first attempts. At the end every final has its event, received at least once and verified with
`standardwebhooks`; no event names a request that is not final; a duplicate carries the webhook-id
(and the body) of its first; nothing is left to deliver."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from redis.asyncio import Redis

from sluice.broker.registry import ModelRegistry
from sluice.broker.webhooks.endpoints import EndpointStore
from sluice.broker.webhooks.outbox import DUE
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from tests.broker.helpers import KEYS, MODEL, admission, cancels, done_result, message, ready_consumer
from tests.workers.webhook_receiver import Receiver, fails_share

REQUESTS, UNFINISHED, KILLS = 1000, 40, 8


def start_sender(redis_url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "SLUICE_REDIS_URL": redis_url, "SLUICE_WEBHOOKS_ALLOW_PRIVATE": "1",
           "SLUICE_WEBHOOKS_RETRY_BASE_S": "0.2", "SLUICE_WEBHOOKS_TIMEOUT_S": "1", "SLUICE_WEBHOOKS_LEASE_S": "1"}
    with log.open("a") as out:
        return subprocess.Popen([sys.executable, "-m", "sluice.workers.webhooks.process"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def test_a_sender_killed_repeatedly_loses_no_event(redis: Redis, redis_url: str, settings: Settings,
                                                         tmp_path: Path) -> None:
    rng = random.Random(33)
    await ModelRegistry(redis).deploy(ModelConfig(name=MODEL))
    receiver = await Receiver(answer=fails_share(1 / 3)).start()
    endpoint = await EndpointStore(redis).create(receiver.url, [], owner="")
    log = tmp_path / "sender.log"
    sender = start_sender(redis_url, log)
    adm = admission(redis, settings)
    finals: dict[str, str] = {}
    try:
        messages = [message() for _ in range(REQUESTS + UNFINISHED)]
        for m in messages:
            await adm.submit(m, max_queued=10 * REQUESTS)
        unfinished = {m.id for m in messages[REQUESTS:]}  # admitted, never fetched: no final, no event
        c = await ready_consumer(redis, settings)
        kills, next_kill = 0, time.monotonic() + 0.5
        for m in messages[:REQUESTS]:
            roll = rng.random()
            if roll < 0.05:
                assert await cancels(redis, settings).cancel(KEYS.model, m.id) == "cancelled"
                finals[m.id] = "cancelled"
        while len(finals) < REQUESTS:
            for d in await c.fetch(50, 100):
                if d.message.id in unfinished:
                    c.release(d)
                    continue
                assert await c.start(d) == "run"
                if rng.random() < 0.05:
                    assert await c.dead_letter(d.stream, d.entry_id, d.message.id, d.message.model_dump_json(),
                                               "boom", 3, d.message)
                    finals[d.message.id] = "failed"
                else:
                    assert await c.commit(d, done_result()) is True
                    finals[d.message.id] = "done"
            if time.monotonic() > next_kill and kills < KILLS:  # SIGKILL mid-work, then a new sender
                sender.send_signal(signal.SIGKILL)
                sender.wait()
                kills += 1
                sender = start_sender(redis_url, log)
                next_kill = time.monotonic() + rng.uniform(0.3, 1.0)
            await asyncio.sleep(0.02)
        while kills < KILLS:  # the rest of the kills while the senders catch up
            await asyncio.sleep(rng.uniform(0.3, 1.0))
            sender.send_signal(signal.SIGKILL)
            sender.wait()
            kills += 1
            sender = start_sender(redis_url, log)
        deadline = time.monotonic() + 40
        while {r.event["data"]["id"] for r in receiver.got if r.event["type"] != "webhook.test"} < set(finals):
            assert time.monotonic() < deadline, (f"{len(set(finals))} finals, events for "
                                                 f"{len({r.event['data']['id'] for r in receiver.got})}:\n"
                                                 + log.read_text()[-3000:])
            assert sender.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.1)
        while await redis.zcard(DUE):  # the last retries settle
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.1)
    finally:
        sender.send_signal(signal.SIGKILL)
        sender.wait()
        await receiver.stop()
    words = {"done": "completed", "failed": "failed", "cancelled": "cancelled"}
    by_rid: dict[str, set[str]] = {}
    for got in receiver.got:
        event = got.verify(endpoint.secret)
        rid = event["data"]["id"]
        assert rid in finals, f"an event for {rid}, which is not final"
        assert event["type"] == f"request.{words[finals[rid]]}"
        by_rid.setdefault(rid, set()).add(got.headers["webhook-id"])
    assert set(by_rid) == set(finals) and not set(by_rid) & unfinished
    assert all(len(ids) == 1 for ids in by_rid.values()), "a duplicate with another webhook-id"
    assert all(len({r.body for r in tries}) == 1 for tries in receiver.by_id().values())
    retried = sum(len(tries) > 1 for tries in receiver.by_id().values())
    print(f"{len(finals)} finals, {len(receiver.got)} posts, {retried} events posted more than once, {KILLS} kills")
    assert retried >= REQUESTS // 5  # a third of first attempts failed: they came again
