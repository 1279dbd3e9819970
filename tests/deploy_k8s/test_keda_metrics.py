"""What KEDA's redis-streams scaler reads for each trigger of a model's ScaledObject, read the way
it reads it (pkg/scalers/redis_streams_scaler.go at KEDA v2.20.2) from a Redis that Sluice's own
admission and consumer fill: the triggers count the requests they are meant to count."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.delivery.consumer import StreamConsumer
from sluice.broker.intake.admission import Admission
from sluice.broker.intake.queues import queue_figures
from sluice.broker.keys import ModelKeys
from sluice.broker.keys import staged as staged_stream
from sluice.broker.limits import ConsumerLimits
from sluice.config.model import load_models
from sluice.config.settings import Settings
from sluice.config.tenants import DEFAULT_TENANT
from tests.broker.helpers import admission, done_result
from tests.broker.helpers import message as make_message

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted((K8S / "overlays").glob("*/scaledobject.yaml"))


async def keda_reads(redis: Redis, meta: dict[str, str]) -> int:
    """The value KEDA hands the HPA for one redis-streams trigger."""
    stream, group = meta["stream"], meta.get("consumerGroup", "")
    if not group:
        return await redis.xlen(stream)
    if int(meta.get("lagCount", "0")):  # lagCount set: the group's lag (Redis 7+)
        try:
            groups = await redis.xinfo_groups(stream)
        except ResponseError as err:
            if "no such key" in str(err):
                return 0
            raise
        for found in groups:
            if found["name"] == group:
                return found["lag"] or 0  # a lag Redis cannot tell (nil) reads as 0 in go-redis
        return await redis.xlen(stream)  # no group yet (no worker ever ran): the stream's length
    return (await redis.xpending(stream, group))["pending"]


async def waiting(redis: Redis, found: dict[str, dict[str, str]], lane: str) -> int:
    """What KEDA sees waiting on a lane: its lag trigger's and its staged trigger's figures
    (requests staged for their tenant's turn wait outside the group)."""
    return await keda_reads(redis, found[f"{lane}-lag"]) + await keda_reads(redis, found[f"{lane}-staged"])


def triggers(path: Path) -> dict[str, dict[str, str]]:
    doc = yaml.safe_load(path.read_text())
    return {t["name"]: t["metadata"] for t in doc["spec"]["triggers"]}


async def submit(adm: Admission, model: str, n: int, lane: str = "interactive") -> None:
    for _ in range(n):
        m = make_message(lane=lane)
        await adm.submit(m.model_copy(update={"model": model}), max_queued=1000)


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.parent.name)
async def test_triggers_count_waiting_and_held_requests(path: Path, redis: Redis, settings: Settings) -> None:
    model = path.parent.name
    keys, found = ModelKeys(model), triggers(path)
    staged_req, staged_bulk = staged_stream(keys.requests, DEFAULT_TENANT), staged_stream(keys.bulk, DEFAULT_TENANT)
    assert {m["stream"] for m in found.values()} == {keys.requests, keys.bulk, staged_req, staged_bulk}
    adm = admission(redis, settings)

    # Before any worker ran there is no consumer group: KEDA falls back to the stream's length
    # for the lag (what scales a model up from zero workers).
    await submit(adm, model, 5)
    assert await waiting(redis, found, "interactive") == 5
    assert await waiting(redis, found, "bulk") == 0  # no such stream yet

    worker = StreamConsumer(redis, model, "w1", ConsumerLimits.of(settings, lease_timeout_s=30.0))
    await worker.ensure_groups()
    await submit(adm, model, 5)
    await submit(adm, model, 3, lane="bulk")
    held = await worker.fetch(4, 100)
    assert [d.stream for d in held] == [keys.requests] * 4
    assert await keda_reads(redis, found["interactive-pending"]) == 4  # held by workers
    assert await waiting(redis, found, "interactive") == 6  # no worker took them yet
    assert await waiting(redis, found, "bulk") == 3
    # The same figures as the api's metrics: pending is sluice_queue_running, lag sluice_queue_depth.
    figures = await queue_figures(redis, model)
    assert (figures["interactive"].running, figures["interactive"].waiting) == (4, 6)
    assert (figures["bulk"].running, figures["bulk"].waiting) == (0, 3)

    # A finished request leaves both counts (its entry is acknowledged and deleted).
    oldest = held[0]
    assert await worker.start(oldest) == "run"
    assert await worker.commit(oldest, done_result()) is True
    assert await keda_reads(redis, found["interactive-pending"]) == 3
    assert await waiting(redis, found, "interactive") == 6

    # The entry delivered last finishing while older ones run: Redis may not tell the lag then
    # (a deleted entry at the group's last-delivered id), and KEDA reads 0 until the group reads
    # on. The pending trigger still counts, and the HPA's scale-down window outlasts it.
    newest = held[-1]
    assert await worker.start(newest) == "run"
    assert await worker.commit(newest, done_result()) is True
    assert await keda_reads(redis, found["interactive-pending"]) == 2
    lag = await keda_reads(redis, found["interactive-lag"])
    staged = await keda_reads(redis, found["interactive-staged"])
    assert lag + staged == 6 or lag == 0, (lag, staged, await redis.xinfo_groups(keys.requests))
    await worker.fetch(1, 100)
    assert await waiting(redis, found, "interactive") == 5
    assert await keda_reads(redis, found["interactive-pending"]) == 3


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.parent.name)
def test_the_triggers_carry_waiting_plus_running(path: Path) -> None:
    """The load a model's workers carry is waiting plus running (sluice_queue_depth +
    sluice_queue_running); the HPA takes the largest of the triggers' replica counts,
    max(running / pending target, waiting / lag target), never their sum. With the two targets
    together at most a worker's slots S, that is never fewer workers than (waiting + running) / S:
    (r + w) / S <= (r + w) / (P + L) <= max(r / P, w / L)."""
    model = next(m for m in load_models(K8S / "base" / "models.yaml") if m.name == path.parent.name)
    assert model.continuous_batching_config is not None
    slots = model.continuous_batching_config.max_concurrent_batch_size
    found = triggers(path)
    pending, lag = int(found["interactive-pending"]["pendingEntriesCount"]), int(found["interactive-lag"]["lagCount"])
    staged = int(found["interactive-staged"]["streamLength"])
    assert pending + lag + staged <= slots, (pending, lag, staged, slots)
    for running in range(0, 4 * slots, 7):
        for on_lane in range(0, 2 * slots, 13):
            for waiting in range(0, 2 * slots, 11):  # staged
                wanted = max(-(-running // pending), -(-on_lane // lag), -(-waiting // staged))  # the HPA's (ceil)
                assert wanted * slots >= running + on_lane + waiting, (running, on_lane, waiting, wanted)
