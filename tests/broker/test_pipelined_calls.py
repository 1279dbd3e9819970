"""Script calls made in one turn of the event loop share one pipeline, and each still answers,
fails or is cancelled on its own."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from sluice.broker.plumbing.connection import is_cluster
from sluice.broker.plumbing.scripts import PipelinedCalls, Scripts

ECHO = "if ARGV[1] == 'fail' then return redis.error_reply('refused ' .. KEYS[1]) end return KEYS[1] .. ':' .. ARGV[1]"


@pytest.fixture
def calls(redis: Redis) -> PipelinedCalls:
    if is_cluster(redis):
        pytest.skip("on a cluster each script call goes alone")
    return PipelinedCalls(redis)


async def test_calls_of_one_turn_share_a_pipeline_and_answer_each(redis: Redis, calls: PipelinedCalls,
                                                                  monkeypatch) -> None:
    sent: list[int] = []
    execute = calls._execute

    async def counted(batch):
        sent.append(len(batch))
        return await execute(batch)

    monkeypatch.setattr(calls, "_execute", counted)
    echo = calls.bind(redis.register_script(ECHO))
    await redis.script_load(ECHO)  # (else the first pipeline meets NOSCRIPT, and is sent again)
    answers = await asyncio.gather(*(echo(keys=[f"k{i}"], args=[str(i)]) for i in range(20)),
                                   return_exceptions=True)
    assert answers == [f"k{i}:{i}" for i in range(20)]
    assert sent == [20]  # one round trip
    assert await echo(keys=["alone"], args=["x"]) == "alone:x"
    assert sent == [20, 1]


async def test_a_failing_call_fails_alone(redis: Redis, calls: PipelinedCalls) -> None:
    echo = calls.bind(redis.register_script(ECHO))
    answers = await asyncio.gather(echo(keys=["a"], args=["1"]), echo(keys=["b"], args=["fail"]),
                                   echo(keys=["c"], args=["3"]), return_exceptions=True)
    assert answers[0] == "a:1" and answers[2] == "c:3"
    assert isinstance(answers[1], ResponseError) and "refused b" in str(answers[1])


async def test_scripts_lost_by_redis_are_loaded_again(redis: Redis, calls: PipelinedCalls) -> None:
    echo = calls.bind(redis.register_script(ECHO))
    assert await echo(keys=["a"], args=["1"]) == "a:1"
    await redis.script_flush()  # a Redis restarted without its scripts
    answers = await asyncio.gather(*(echo(keys=[f"k{i}"], args=[str(i)]) for i in range(5)))
    assert answers == [f"k{i}:{i}" for i in range(5)]


async def test_redis_away_fails_every_call_of_the_pipeline(redis: Redis, calls: PipelinedCalls,
                                                          monkeypatch) -> None:
    async def away(_):
        raise RedisConnectionError("Redis is away")

    monkeypatch.setattr(calls, "_execute", away)
    echo = calls.bind(redis.register_script(ECHO))
    answers = await asyncio.gather(*(echo(keys=["a"], args=[str(i)]) for i in range(3)), return_exceptions=True)
    assert all(isinstance(a, RedisConnectionError) for a in answers)


async def test_a_cancelled_caller_leaves_the_others_their_answers(redis: Redis, calls: PipelinedCalls) -> None:
    echo = calls.bind(redis.register_script(ECHO))
    first = asyncio.ensure_future(echo(keys=["a"], args=["1"]))
    second = asyncio.ensure_future(echo(keys=["b"], args=["2"]))
    await asyncio.sleep(0)
    first.cancel()
    assert await second == "b:2"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_registered_scripts_are_pipelined_off_a_cluster_only(redis: Redis) -> None:
    pipelined = Scripts(redis, pipelined=True)
    plain = Scripts(redis)
    assert plain.pipelined is None
    if is_cluster(redis):
        assert pipelined.pipelined is None  # the plain scripts: redis-py's cluster pipeline refuses them
    else:
        assert isinstance(pipelined.pipelined, PipelinedCalls)


async def test_a_failed_reload_fails_only_the_calls_that_did_not_run(redis: Redis, calls: PipelinedCalls,
                                                                     monkeypatch) -> None:
    loaded = calls.bind(redis.register_script(ECHO))
    other = calls.bind(redis.register_script(ECHO + " -- another script"))
    await redis.script_flush()
    await redis.script_load(ECHO)  # the first is loaded, the other is not

    async def away(_: str) -> None:
        raise RedisConnectionError("Redis went away while loading")

    monkeypatch.setattr(redis, "script_load", away)
    answers = await asyncio.gather(loaded(keys=["a"], args=["1"]), other(keys=["b"], args=["2"]),
                                   return_exceptions=True)
    assert answers[0] == "a:1"  # it ran: its answer, not the reload's failure
    assert isinstance(answers[1], RedisConnectionError)
