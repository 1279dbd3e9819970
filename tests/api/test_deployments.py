"""Deployments as the api sees them: reading never writes, and the models file is kept deployed
by ModelsFileSync without undoing a run-time reconfiguration."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from sluice.api.deployments import Deployments, ModelsFileSync
from sluice.api.errors import ApiError
from sluice.broker.keys import MODELS
from sluice.broker.registry import ModelRegistry
from sluice.config.batching import ContinuousBatchingConfig
from sluice.config.model import ModelConfig

A = ModelConfig(name="a", continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=4))
B = ModelConfig(name="b", batch_config="single")


def deployments(redis: Redis, *configured: str) -> Deployments:
    return Deployments(ModelRegistry(redis), default_model=None, configured=frozenset(configured), ttl_s=0.0)


async def test_a_missing_configured_model_is_a_503_and_nothing_is_written(redis: Redis) -> None:
    d = deployments(redis, "a")
    with pytest.raises(ApiError) as refused:
        await d.get("a")
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert d.missing.is_set()  # the sync is woken
    assert await redis.hlen(MODELS) == 0


async def test_an_unknown_model_is_a_404_naming_it(redis: Redis) -> None:
    with pytest.raises(ApiError) as missing:
        await deployments(redis).get("nope")
    assert missing.value.status == 404 and "'nope'" in missing.value.message
    with pytest.raises(ApiError, match="no model is deployed"):
        await deployments(redis).get(None)


async def test_without_a_name_the_default_or_the_first_by_name(redis: Redis) -> None:
    d = deployments(redis)
    await d.deploy(B)
    await d.deploy(A)
    assert (await d.get(None)).name == "a"
    d.default_model = "b"
    assert (await d.get(None)).name == "b"


async def test_the_sync_registers_what_is_missing_and_keeps_a_reconfiguration(redis: Redis) -> None:
    d = deployments(redis, "a", "b")
    sync = ModelsFileSync(d, [A, B])
    assert sorted(await sync.sync()) == ["a", "b"]
    changed = await d.deploy(A.model_copy(update={"continuous_batching_config":
                                                  ContinuousBatchingConfig(max_concurrent_batch_size=8)}))
    assert await sync.sync() == []
    assert (await d.get("a")).version == changed.version  # the run-time change is kept


async def test_the_sync_task_comes_when_woken_and_stops_on_its_flag(redis: Redis) -> None:
    d = deployments(redis, "a")
    sync = ModelsFileSync(d, [A], interval_s=3600)  # only a wake-up can bring it within the test
    task = asyncio.create_task(sync.run())
    with pytest.raises(ApiError):
        await d.get("a")
    await asyncio.wait_for(_until_deployed(d), 30)
    sync.stop()
    await asyncio.wait_for(task, 30)


async def _until_deployed(d: Deployments) -> None:
    while "a" not in await d.all(fresh=True):
        await asyncio.sleep(0.01)


async def test_a_model_dropped_from_the_models_file_is_undeployed(redis: Redis) -> None:
    """An api that starts with a models file no longer listing `b` undeploys it (it once stayed
    deployed and kept taking requests); `a`'s run-time reconfiguration is kept."""
    first = deployments(redis, "a", "b")
    await ModelsFileSync(first, [A, B]).sync()
    changed = await first.deploy(A.model_copy(update={"continuous_batching_config":
                                                      ContinuousBatchingConfig(max_concurrent_batch_size=8)}))
    restarted = deployments(redis, "a")
    await ModelsFileSync(restarted, [A]).sync()
    assert sorted(await restarted.all(fresh=True)) == ["a"]
    assert (await restarted.get("a")).version == changed.version
    with pytest.raises(ApiError) as gone:
        await restarted.get("b")
    assert gone.value.status == 404 and "'b' is not deployed" in gone.value.message


async def test_an_api_without_a_models_file_undeploys_nothing(redis: Redis) -> None:
    await ModelsFileSync(deployments(redis, "a", "b"), [A, B]).sync()
    await ModelsFileSync(deployments(redis), []).sync()  # models deployed by the workers' files stay
    assert sorted(await deployments(redis).all(fresh=True)) == ["a", "b"]
