"""The api's reply router: many open streams on a few connections, a new stream never waiting
out a blocked read, the final from the status hash once a reply stream has expired."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.broker.plumbing.connection import connect, is_cluster
from sluice.broker.plumbing.readers import Readers
from sluice.broker.replies import router as reply_router
from sluice.broker.replies import shards as reply_shards
from sluice.broker.replies.router import ReplyRouter, resume_index
from sluice.protocol.messages import DeltaEvent, FinalResult, RowOutput, State
from sluice.supervisor.processes import EmbeddedRedis as Node
from tests.broker.conftest import READER
from tests.broker.helpers import KEYS, MODEL
from tests.fakes import eventually


async def delta(redis: Redis, rid: str, i: int, text: str) -> None:
    ev = DeltaEvent(i=i, text=text, token_ids=[i])
    await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": ev.model_dump_json()})


def final(text: str) -> FinalResult:
    return FinalResult(status=State.DONE, output=RowOutput(text=text, num_output_tokens=len(text.split())))


async def finish(redis: Redis, rid: str, text: str) -> None:
    data = final(text).model_dump_json()
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": data})
    await redis.hset(KEYS.status(rid), mapping={"state": "done", "result": data})


async def texts(router: ReplyRouter, rid: str, **kw: object) -> list[str]:
    out = []
    async for ev in router.follow(MODEL, rid, **kw):
        out.append(ev.delta.text if ev.delta else f"final:{ev.final.output.text}")
    return out


async def connections(redis: Redis, name: str = READER) -> int:
    return sum(1 for c in await redis.client_list(**on_models_node(redis)) if c.get("name") == name)


def on_models_node(redis: Redis) -> dict:
    """Where the model's readers are: the server, or in a cluster the node of its slot."""
    return {"target_nodes": redis.get_node_from_key(KEYS.requests)} if is_cluster(redis) else {}


async def test_many_streams_are_followed_on_as_many_connections_as_shards(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    router = make_router(shards=2, block_ms=30_000)
    rids = [f"req-many-{n}" for n in range(300)]
    followers = [asyncio.create_task(texts(router, rid)) for rid in rids[:2]]
    await eventually(lambda: router.following == 2, what="the shards blocked in their reads")
    await asyncio.sleep(0.2)
    await redis.config_resetstat(**on_models_node(redis))
    followers += [asyncio.create_task(texts(router, rid)) for rid in rids[2:]]
    await eventually(lambda: router.following == len(rids), what="every stream followed")
    async def both_connected() -> bool:
        return await connections(redis) == 2

    await eventually(both_connected, interval_s=0.05, what="the readers connected")
    shared = [c for c in await redis.client_list(**on_models_node(redis)) if c.get("name") == "sluice-test-shared"]
    # (a cluster client kept the connection that first asked for the slots, past its bound)
    assert await connections(redis) == 2 and len(shared) <= 8, [(c["id"], c["age"], c["cmd"]) for c in shared]
    for n, rid in enumerate(rids):
        await delta(redis, rid, 0, f" a{n}")
        await delta(redis, rid, 1, f" b{n}")
        await finish(redis, rid, f" a{n} b{n}")
    got = await asyncio.wait_for(asyncio.gather(*followers), 60)
    assert got == [[f" a{n}", f" b{n}", f"final: a{n} b{n}"] for n in range(len(rids))]
    # 298 streams opening at once unblocked each shard's read a few times, not once each
    # (one CLIENT UNBLOCK per read under way).
    stats = await redis.info("commandstats", **on_models_node(redis))
    unblocks = stats.get("cmdstat_client|unblock", {"calls": 0})["calls"]
    assert 0 < unblocks <= 20, unblocks
    assert router.following == 0 and await connections(redis) == 2


async def test_a_flush_to_every_stream_of_a_filling_shard_is_one_read(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    # A worker writes one flush's tokens for every stream of a model in one call. Followers
    # fill one shard before the next: however many shards there may be, a few dozen streams
    # are answered by one read per flush, not one per shard (each a read to parse and send
    # again in the api, and a blocked read to serve in Redis).
    router = make_router(shards=4, block_ms=30_000)
    rids = [f"req-fill-{n}" for n in range(40)]
    followers = [asyncio.create_task(texts(router, rid)) for rid in rids]
    await eventually(lambda: router.following == len(rids), what="every stream followed")
    assert sum(1 for s in router._shards.values() if s.size) == 1

    async def blocked() -> bool:  # the shard's read of every stream, waiting (a flush answers it at once)
        return any(c.get("name") == READER and "b" in c["flags"] and c["cmd"] == "xread"
                   for c in await redis.client_list(**on_models_node(redis)))

    for n in range(3):
        await eventually(blocked, interval_s=0.05, what="the shard's read blocked")
        await redis.config_resetstat(**on_models_node(redis))
        flush = "for i, key in ipairs(KEYS) do redis.call('XADD', key, '*', 'kind', 'delta', 'data', ARGV[i]) end"
        await redis.eval(flush, len(rids), *(KEYS.reply(rid) for rid in rids),
                         *(DeltaEvent(i=n, text=f" t{n}", token_ids=[n]).model_dump_json() for _ in rids))
        await eventually(blocked, interval_s=0.05, what="the shard reading again")
        stats = await redis.info("commandstats", **on_models_node(redis))
        # one read answered (Redis 7.0 counts a read that blocked twice: as it blocks, and as it
        # is answered); spread over the four shards, the flush was four reads
        assert stats["cmdstat_xread"]["calls"] <= 2, stats["cmdstat_xread"]
    for rid in rids:
        await finish(redis, rid, " t0 t1 t2")
    got = await asyncio.wait_for(asyncio.gather(*followers), 30)
    assert got == [[" t0", " t1", " t2", "final: t0 t1 t2"] for _ in rids]


async def test_a_second_reader_in_a_full_shard_goes_to_the_next_and_still_gets_every_token_once(
        redis: Redis, make_router: Callable[..., ReplyRouter], monkeypatch: pytest.MonkeyPatch) -> None:
    # Shards fill in order: a second reader of a stream that joins mid-read once the first
    # shard is full is read by another shard, from its own position, each token once.
    monkeypatch.setattr(reply_shards, "SHARD_FILL", 1)
    router = make_router(shards=2, block_ms=30_000)
    first = asyncio.create_task(texts(router, "req-split"))
    await eventually(lambda: router.following == 1, what="the first reader followed")
    await delta(redis, "req-split", 0, " a")
    second = asyncio.create_task(texts(router, "req-split"))
    await eventually(lambda: router.following == 2, what="the second reader followed")
    assert [s.size for s in router._shards.values()] == [1, 1]
    await delta(redis, "req-split", 1, " b")
    await finish(redis, "req-split", " a b")
    assert await asyncio.wait_for(first, 20) == [" a", " b", "final: a b"]
    assert await asyncio.wait_for(second, 20) == [" a", " b", "final: a b"]


async def test_a_new_stream_does_not_wait_for_the_blocked_read_to_end(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    # One shard, blocked for a minute on a first stream: the second stream's token must still
    # come at once, well inside the block.
    router = make_router(shards=1, block_ms=60_000)
    first = asyncio.create_task(texts(router, "req-first"))
    await eventually(lambda: router.following == 1, what="the first stream followed")
    await a_new_stream_ends_beside(redis, router, first, "req-first", within_s=20)


async def a_new_stream_ends_beside(redis: Redis, router: ReplyRouter, quiet: asyncio.Task, quiet_rid: str, *,
                                   within_s: float) -> None:
    """A new stream on the router of `quiet` (a stream with nothing written, its shard's read
    blocked) gets its token and final within `within_s`, far inside the block; then `quiet` ends."""
    new = asyncio.create_task(texts(router, "req-new"))
    await eventually(lambda: router.following == 2, what="the new stream followed")
    await delta(redis, "req-new", 0, " now")
    await finish(redis, "req-new", " now")
    assert await asyncio.wait_for(new, within_s) == [" now", "final: now"]
    await finish(redis, quiet_rid, "")
    assert await asyncio.wait_for(quiet, within_s) == ["final:"]


async def test_two_readers_of_one_stream_at_different_positions_each_get_their_rest(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    router = make_router(shards=1)
    rid = "req-two-readers"
    await delta(redis, rid, 0, " zero")
    late_after = (await redis.xrange(KEYS.reply(rid)))[-1][0]
    await delta(redis, rid, 1, " one")
    early = asyncio.create_task(texts(router, rid))
    late = asyncio.create_task(texts(router, rid, after=late_after, next_index=1))
    await eventually(lambda: router.following == 2, what="both readers followed")
    await finish(redis, rid, " zero one")
    assert await asyncio.wait_for(early, 20) == [" zero", " one", "final: zero one"]
    assert await asyncio.wait_for(late, 20) == [" one", "final: zero one"]


async def test_a_request_final_long_ago_answers_from_its_status_at_once(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    # The reply stream expired; only the status hash holds the final. No recheck is due for a
    # minute: the answer must come from the check made when the stream is opened.
    router = make_router(shards=1, recheck_s=60)
    await redis.hset(KEYS.status("req-old"), mapping={"state": "done", "result": final(" old").model_dump_json()})
    assert await asyncio.wait_for(texts(router, "req-old"), 20) == ["final: old"]


async def test_a_silent_stream_ends_after_its_idle_timeout(make_router: Callable[..., ReplyRouter]) -> None:
    router = make_router(shards=1, recheck_s=60)
    assert await asyncio.wait_for(texts(router, "req-silent", idle_timeout_s=0.2), 20) == []
    assert router.following == 0


async def test_a_reader_that_leaves_is_forgotten(redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    router = make_router(shards=1)
    stream = router.follow(MODEL, "req-leaver")
    await delta(redis, "req-leaver", 0, " hi")
    assert (await anext(stream)).delta.text == " hi"
    await stream.aclose()  # the client went away mid-stream
    assert router.following == 0


async def test_a_read_blocked_past_the_clients_default_timeout_still_takes_in_new_streams(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    """redis-py 8 times out reads after 5 s unless told otherwise. A shard's read blocked for
    longer then failed, reconnected (another client id: CLIENT UNBLOCK missed it) and was
    retried with the streams it had, so a stream opened meanwhile waited out every retry and
    got its tokens tens of seconds late."""
    router = make_router(shards=1, block_ms=8000)  # blocks past redis-py's default 5 s
    quiet = asyncio.create_task(texts(router, "req-quiet"))  # keeps the shard's read blocked
    await asyncio.sleep(6.0)
    loop = asyncio.get_running_loop()
    got: list[float] = []

    async def follow() -> None:
        async for ev in router.follow(MODEL, "req-new"):
            got.append(loop.time())
            if ev.final is not None:
                return

    sent = loop.time()
    task = asyncio.create_task(follow())
    await delta(redis, "req-new", 0, " now")
    await finish(redis, "req-new", "now")
    await asyncio.wait_for(task, 30)
    assert got[0] - sent < 1.0, f"first token {got[0] - sent:.1f} s late"
    await finish(redis, "req-quiet", "")
    await asyncio.wait_for(quiet, 15)


@pytest.mark.parametrize("seed", range(6))
async def test_every_reader_gets_exactly_the_stream_however_and_whenever_it_joins(
        redis: Redis, make_router: Callable[..., ReplyRouter], seed: int) -> None:
    """Issue 28, defect 1: each reader keeps its own cursor. Many requests written at once,
    each read by a reader from the start, readers that join from the start at random points of
    the writing (while the shard's read for that stream is under way), a reader that hangs up
    after a few events and resumes with the last id it got (as Last-Event-ID does), and one
    that resumes from a random id written so far. Every reader's joined deltas must be exactly
    the stream after its position, in order, then the final. A reader that joined while a read
    for its stream was in flight used to get that read's later entries and skip the earlier ones."""
    rng = random.Random(seed)
    router = make_router(shards=2)
    tokens = 24
    rids = [f"req-readers-{seed}-{n}" for n in range(12)]
    written: dict[str, list[tuple[str, str]]] = {rid: [] for rid in rids}  # (entry id, text) in order
    reached = {rid: [asyncio.Event() for _ in range(tokens + 1)] for rid in rids}  # [k]: k tokens written

    def text(rid: str, i: int) -> str:
        return f" {rid.rpartition('-')[2]}.{i}"

    full = {rid: "".join(text(rid, i) for i in range(tokens)) for rid in rids}

    async def write(rid: str, pauses: list[float]) -> None:
        reached[rid][0].set()
        for i in range(tokens):
            ev = DeltaEvent(i=i, text=text(rid, i), token_ids=[i])
            entry_id = await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": ev.model_dump_json()})
            written[rid].append((entry_id, ev.text))
            reached[rid][i + 1].set()
            await asyncio.sleep(pauses[i])
        await finish(redis, rid, full[rid])

    async def read(rid: str, after: str = "0") -> str:
        next_index = await resume_index(redis, MODEL, rid, after) if after != "0" else 0
        return "".join(await texts(router, rid, after=after, next_index=next_index))

    async def late(rid: str, k: int) -> str:
        await reached[rid][k].wait()
        return await read(rid)

    async def hang_up_and_resume(rid: str, k: int, m: int) -> str:
        await reached[rid][k].wait()
        seen, last = [], "0"
        stream = router.follow(MODEL, rid)
        async for ev in stream:
            seen.append(ev.delta.text if ev.delta else f"final:{ev.final.output.text}")
            last = ev.entry_id
            if len(seen) == m or ev.final is not None:
                break
        await stream.aclose()
        if seen[-1].startswith("final:"):
            return "".join(seen)
        return "".join(seen) + await read(rid, after=last)

    async def from_random_id(rid: str, k: int) -> tuple[str, str]:
        await reached[rid][k].wait()
        n = rng.randrange(k)
        entry_id = written[rid][n][0]
        got = await read(rid, after=entry_id)
        return got, "".join(t for _, t in written[rid][n + 1:]) + f"final:{full[rid]}"

    expected = {rid: full[rid] + f"final:{full[rid]}" for rid in rids}
    checks: list[tuple[str, str, asyncio.Task]] = []
    for rid in rids:
        checks.append(("from the start", rid, asyncio.create_task(read(rid))))
        for _ in range(3):
            checks.append(("late", rid, asyncio.create_task(late(rid, rng.randrange(tokens + 1)))))
        checks.append(("resumed", rid, asyncio.create_task(
            hang_up_and_resume(rid, rng.randrange(tokens + 1), rng.randint(1, tokens)))))
    randoms = [(rid, asyncio.create_task(from_random_id(rid, rng.randint(1, tokens)))) for rid in rids]
    writers = [write(rid, [rng.choice((0, 0, 0, 0.001, 0.003)) for _ in range(tokens)]) for rid in rids]
    await asyncio.wait_for(asyncio.gather(*writers), 60)
    await asyncio.wait_for(asyncio.gather(*(t for *_, t in checks), *(t for _, t in randoms)), 60)
    wrong = [(kind, rid, t.result()) for kind, rid, t in checks if t.result() != expected[rid]]
    wrong += [("from a random id", rid, t.result()[0]) for rid, t in randoms if t.result()[0] != t.result()[1]]
    assert not wrong, f"{len(wrong)} readers got another stream than the one written: {wrong[:3]}"
    assert router.following == 0


async def test_after_redis_restarts_a_new_stream_does_not_wait_out_the_blocked_read(tmp_path: Path) -> None:
    """Issue 28, defect 10: a shard's XREAD that Redis dropped by restarting is reconnected and
    sent again by redis-py's retry, silently. The router kept the old connection's id, so its
    CLIENT UNBLOCK went to a dead id and a new stream's first token waited out the whole block
    (here 30 s; the stream must end well inside it)."""
    node = Node(tmp_path / "redis").start()  # a server of the test's own: it is restarted
    shared = connect(node.url, name="sluice-test-shared", max_connections=8)
    router = ReplyRouter(shared, Readers(node.url, shared, name=READER), shards=1, block_ms=30_000)
    try:
        for _ in range(40):  # client ids after the restart begin at 1 again: the reader's old one is far above
            one = Redis.from_url(node.url)
            await one.ping()
            await one.aclose()
        router.start()
        quiet = asyncio.create_task(texts(router, "req-quiet"))  # keeps the shard's read blocked

        async def blocked_reader() -> int | None:
            readers = [c for c in await shared.client_list() if c.get("name") == READER and c["cmd"] == "xread"]
            return int(readers[0]["id"]) if readers else None

        await eventually(blocked_reader, interval_s=0.05, what="the shard blocked in its read")
        before = await blocked_reader()
        await asyncio.to_thread(node.stop, True)  # kill -9
        await asyncio.to_thread(node.start)
        await eventually(lambda: _blocked_again(blocked_reader, before), timeout_s=30, interval_s=0.05,
                         what="the shard's read sent again on a new connection")

        await a_new_stream_ends_beside(shared, router, quiet, "req-quiet", within_s=15)
    finally:
        await router.close()
        await shared.aclose()
        node.stop()


async def _blocked_again(blocked_reader: Callable[[], Awaitable[int | None]], before: int | None) -> bool:
    try:
        now = await blocked_reader()
    except RedisError:  # still starting
        return False
    return now is not None and now != before


async def test_a_fresh_follower_reads_no_status_before_its_tokens(
        redis: Redis, make_router: Callable[..., ReplyRouter], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request its caller admitted just now (a streamed OpenAI call) cannot have a lost final:
    its follower goes straight to the stream, without the status read an old request's needs."""
    router = make_router(shards=1, block_ms=30_000)
    looked: list[str] = []
    real = reply_router.final_status

    async def counted(client: Redis, key: str) -> FinalResult | None:
        looked.append(key)
        return await real(client, key)

    monkeypatch.setattr(reply_router, "final_status", counted)
    fresh = asyncio.create_task(texts(router, "req-fresh", fresh=True))
    old = asyncio.create_task(texts(router, "req-old"))
    await eventually(lambda: router.following == 2, what="both followers taken in")
    for rid in ("req-fresh", "req-old"):
        await delta(redis, rid, 0, "a")
        await finish(redis, rid, "a")
    assert await fresh == ["a", "final:a"] and await old == ["a", "final:a"]
    assert looked == [KEYS.status("req-old")]
