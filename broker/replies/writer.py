"""Reply channels: one stream per request carrying token deltas, then one final event."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from redis.asyncio import Redis

from sluice.broker.delivery import Delivery
from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing import Scripts
from sluice.broker.replies.calls import Reply, ReplyWrite
from sluice.broker.replies.events import Delivered as Delivered
from sluice.broker.replies.events import ReplyDecoder as ReplyDecoder
from sluice.broker.replies.events import ReplyEvent as ReplyEvent
from sluice.broker.replies.events import delivered as delivered
from sluice.protocol.messages import DeltaEvent, FinalResult

log = logging.getLogger(__name__)

# Consumer.commit: (delivery, final, tokens sent per row or None, deltas to write first)
Commit = Callable[[Delivery, FinalResult, "list[int] | None", list[str]], Awaitable["bool | list[int]"]]


class ReplyWriter:
    """Buffers token deltas and writes everything ready in one script call per flush.

    The engine hands out a token for many requests per step; one call per step (instead of
    one per token per request) keeps Redis and this process off the engine's critical path.
    A flush starts as soon as the one before has returned, with no timer: a lone stream's
    token leaves at once, and at GPU rates what every request generated while a flush was on
    its way goes in the next one, so no token waits longer than one flush. A flush is one
    reply.lua call per slot (a model's shard: its keys share a hash tag, so the call works on a
    Redis Cluster), carrying every request of that slot, each fenced on its own: a worker
    fenced out while frozen cannot add tokens beside its successor's, and the other requests
    of the call are written all the same.
    """

    def __init__(self, redis: Redis, model: str, *, reply_ttl_s: int,
                 on_call: Callable[[], object] | None = None) -> None:
        """`on_call`: told of each reply.lua call (the worker's metrics)."""
        self.redis = redis
        self.on_call = on_call
        self.keys = ModelKeys(model)
        self.scripts = Scripts(redis)
        self.reply_ttl_s = reply_ttl_s
        self._buffer: list[tuple[Delivery, DeltaEvent]] = []
        self._ready = asyncio.Event()
        self._closing = False
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-writer")

    def delta(self, owner: Delivery, event: DeltaEvent) -> None:
        self._buffer.append((owner, event))
        row = owner.sent.rows.setdefault(event.row, {})
        row[event.i] = _kept(event)
        if len(row) > _KEPT:
            del row[next(iter(row))]
        self._ready.set()

    async def flush(self) -> None:
        """Write what is buffered now (a commit takes its own request's deltas: see commit)."""
        # The lock makes a flush wait for a write in progress: deltas must keep their order.
        async with self._lock:
            pending, self._buffer = self._buffer, []
            for _ in range(8):  # a resend round per failover met on the way
                if not pending:
                    return
                batch = _coalesce(pending)
                # One request per entry and attempt: an earlier attempt's leftovers (a worker that
                # gave the request up, then took it over again under its name) are fenced on their own.
                by_entry: dict[tuple[tuple[str, str], int], tuple[Delivery, list[DeltaEvent]]] = {}
                for d, ev in batch:
                    by_entry.setdefault((d.key, d.attempt), (d, []))[1].append(ev)
                sent_at = time.monotonic()
                try:
                    answers = await self._write([
                        ReplyWrite(reply=self.keys.reply(d.message.id), status=self.keys.status(d.message.id),
                                   fence=d.fence, reply_ttl=0 if d.sent.ttl_set else self.reply_ttl_s,
                                   deltas=tuple(ev.model_dump_json(exclude_none=True) for ev in events))
                        for d, events in by_entry.values()])
                except BaseException:
                    # Not known to be written (Redis away, or restarted without its scripts): keep
                    # the deltas for the next flush. reply.lua drops what did land, so a resend
                    # writes no token twice, and the stream never gets a hole.
                    self._buffer[:0] = batch
                    raise
                pending = []
                for (d, _), answer in zip(by_entry.values(), answers):
                    d.sent.ttl_set = True  # set by this attempt's first write: later ones skip it
                    if isinstance(answer, list):  # refused: the stream ends before them
                        pending += _refill(d, answer)
                    elif answer:  # written: the answer says whether it has a cancel (heard_cancel)
                        d.sent.heard_at, d.sent.cancel = sent_at, answer == 2
            self._buffer[:0] = pending

    async def commit(self, d: Delivery, final: FinalResult, commit: Commit) -> bool:
        """Commit, this request's deltas not flushed yet riding on the commit (one call, deltas
        before the final, in one script). A commit refused (the stream short of the tokens sent:
        a failover lost its tail, which no later delta would find; or a delta past such a hole)
        gets them sent again from where the stream ends. A commit never goes through over a
        hole: one this attempt cannot fill (see _refill) leaves the request uncommitted, its
        entry pending, for a retry that resumes from where the stream ends (False)."""
        outputs = final.rows or ([final.output] if final.output else [])
        for _ in range(3):
            async with self._lock:  # a flush under way ends first: its deltas precede these
                own = [(o, ev) for o, ev in self._buffer if o.key == d.key]
                self._buffer = [(o, ev) for o, ev in self._buffer if o.key != d.key]
            events = [ev for _, ev in _coalesce(own)]
            try:
                answer = await commit(d, final, [o.num_output_tokens for o in outputs],
                                      [ev.model_dump_json(exclude_none=True) for ev in events])
            except BaseException:  # not known to be written: the writer sends them (see flush)
                self._buffer[:0] = own
                raise
            if not isinstance(answer, list):
                return answer
            log.warning("request %s: its reply stream lost tokens (%s): sending them again", d.message.id,
                        answer)
            async with self._lock:
                self._buffer[:0] = _refill(d, answer)
        log.warning("request %s: its reply stream has a hole this attempt cannot fill: not committed, "
                    "left for a retry (it resumes from where the stream ends)", d.message.id)
        return False

    async def _write(self, requests: list[ReplyWrite]) -> list[object]:
        """Each request's answer. The requests of one slot go in one call, the slots' calls side
        by side."""
        slots: dict[str, list[int]] = {}
        for n, request in enumerate(requests):
            slots.setdefault(_hash_tag(request.reply), []).append(n)
        calls = [Reply(requests=tuple(requests[n] for n in ns)) for ns in slots.values()]
        if len(calls) == 1:
            results = [await self._call(calls[0])]
        else:
            results = list(await asyncio.gather(*(self._call(call) for call in calls)))
        answers: list[object] = [None] * len(requests)
        for ns, got in zip(slots.values(), results):
            for n, answer in zip(ns, got):
                answers[n] = answer
        return answers

    async def _call(self, call: Reply) -> list[object]:
        # A Redis that restarted without the script ran none of the call (NOSCRIPT): Scripts
        # loads it and sends the call again, through this writer's client.
        if self.on_call is not None:
            self.on_call()
        return await self.scripts(call)

    async def _run(self) -> None:
        while not self._closing:
            await self._ready.wait()
            self._ready.clear()
            try:
                await self.flush()
            except Exception:  # a Redis blip must not kill the writer; the final still lands
                log.exception("writing token deltas failed; retrying")
                await asyncio.sleep(0.1)
                self._ready.set()  # the deltas are still buffered

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop the writer (on a flag: see Worker.run) and write what is left."""
        self._closing = True
        self._ready.set()
        if self._task:
            _, late = await asyncio.wait([self._task], timeout=timeout_s)
            for task in late:
                task.cancel()
        await self.flush()


def _hash_tag(key: str) -> str:
    """The hash tag of a key (`{m:<model>}` or a shard's `{m:<model>:<k>}`): its slot."""
    return key[key.index("{"):key.index("}") + 1]


_KEPT = 2048  # deltas kept per row for a resend (a failover loses the last moments, not minutes)


def heard_cancel(runs: Mapping[str, Delivery], fresh_after: float) -> tuple[set[str], list[str]]:
    """The worker's cancel watch, from what reply.lua answered: the requests whose last answer
    said they have a cancel, and those with no answer sent after `fresh_after` (time.monotonic),
    whose cancel flags the watch reads. A request streaming tokens is answered at every flush,
    so at GPU rates the watch reads nothing; one in its prefill, or between slow tokens, is read."""
    heard = {rid for rid, d in runs.items() if d.sent.cancel}
    return heard, [rid for rid, d in runs.items() if rid not in heard and d.sent.heard_at <= fresh_after]


def _kept(ev: DeltaEvent) -> tuple:
    """A delta as kept for a resend: a plain tuple of its fields, which the garbage collector
    stops tracking (ints, strings and tuples of them hold no reference cycle). A worker keeps
    every running request's deltas, tens of thousands at GPU rates; kept as models (four
    tracked objects each) they made each full collection walk them all, a pause of 30 to 60 ms
    on the worker's event loop every few seconds under load (docs/performance.md)."""
    if ev.logprobs is None and ev.prompt_logprobs is None:
        return ev.i, ev.text, tuple(ev.token_ids), ev.attempt, ev.row, ev.finish
    return ev.i, ev.text, tuple(ev.token_ids), ev.attempt, ev.row, ev.finish, ev.logprobs, ev.prompt_logprobs


def _event(kept: tuple) -> DeltaEvent:
    i, text, ids, attempt, row, finish, *lp = kept
    return DeltaEvent(i=i, text=text, token_ids=list(ids), attempt=attempt, row=row, finish=finish,
                      logprobs=lp[0] if lp else None, prompt_logprobs=lp[1] if lp else None)


def _refill(d: Delivery, answer: list[int]) -> list[tuple[Delivery, DeltaEvent]]:
    """What to send again after reply.lua refused deltas past a hole: for each refused row, the
    row's index the stream ends at, from which this attempt's deltas are sent again. A failover
    lost them: the old primary acknowledged them, its replica never had them.

    A hole this attempt cannot fill (it began after that index, resumed from tokens that the
    failover then lost; or its kept deltas do not reach back) is never written past: nothing
    goes again, the row's later deltas are refused too, and the commit does not go through
    (the retry resumes from where the stream ends, so what was streamed and the final agree)."""
    out: list[tuple[Delivery, DeltaEvent]] = []
    for row, at in zip(answer[::2], answer[1::2]):
        sent = d.sent.rows.get(row, {})
        while (kept := sent.get(at)) is not None:
            ev = _event(kept)
            out.append((d, ev))
            if ev.finish is not None or not ev.token_ids:
                break
            at += len(ev.token_ids)
    return out


def _coalesce(buffer: list[tuple[Delivery, DeltaEvent]]) -> list[tuple[Delivery, DeltaEvent]]:
    """Join the buffered deltas of each (entry, row) into one: when writes lag behind the
    engine, fewer and larger entries keep Redis and the readers from falling further behind."""
    out: list[tuple[Delivery, DeltaEvent]] = []
    last: dict[tuple[str, int, int], int] = {}  # (entry, attempt, row) -> its latest position in out
    for d, ev in buffer:
        key = (d.entry_id, d.attempt, ev.row)
        at = last.get(key)
        joined = _joined(out[at][1], ev) if at is not None else None
        if at is not None and joined is not None:
            out[at] = (d, joined)
        else:
            last[key] = len(out)
            out.append((d, ev))
    return out


def _joined(prev: DeltaEvent, ev: DeltaEvent) -> DeltaEvent | None:
    """`ev` joined to `prev` when it goes on from where `prev` ends (its row's next index)."""
    if prev.finish is not None or prev.i + len(prev.token_ids) != ev.i:
        return None
    update: dict[str, object] = {"text": prev.text + ev.text, "token_ids": prev.token_ids + ev.token_ids,
                                 "finish": ev.finish}
    if prev.logprobs is not None or ev.logprobs is not None:
        update["logprobs"] = (prev.logprobs or []) + (ev.logprobs or [])
    return prev.model_copy(update=update)
