"""The Lua scripts that make each broker change atomic, registered once per client."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from sluice.broker.affinity import COUNT_DECAY, GROUPS_MAX
from sluice.broker.connection import is_cluster
from sluice.broker.keys import ACTIVE_S, GROUP, VTC_TTL_S
from sluice.broker.webhooks import OUTBOX_MAX_LEN
from sluice.protocol.states import FINAL_BATCH_STATES, FINAL_STATES


def _read(name: str) -> str:
    return resources.files("sluice.broker").joinpath(f"lua/{name}.lua").read_text()


def _lua_set(states: Iterable[enum.Enum]) -> str:
    return "{" + ", ".join(f"['{s.value}'] = true" for s in sorted(states, key=lambda s: s.value)) + "}"


def prelude() -> str:
    """Finality, defined once: protocol/states.py's final states as the Lua tables that
    lua/_lib.lua's is_final_state (a request) and job_move.lua (a batch) ask."""
    return (f"local FINAL_STATES = {_lua_set(FINAL_STATES)}  -- protocol/states.py\n"
            f"local BATCH_FINAL = {_lua_set(FINAL_BATCH_STATES)}  -- protocol/states.py\n"
            f"local OUTBOX_MAX_LEN = {OUTBOX_MAX_LEN}  -- broker/webhooks.py\n"
            f"local GROUP = '{GROUP}'  -- broker/keys.py\n"
            f"local VTC_TTL_S = {VTC_TTL_S}  -- broker/keys.py\n"
            f"local ACTIVE_S = {ACTIVE_S}  -- broker/keys.py\n"
            f"local AFFINITY_GROUPS_MAX = {GROUPS_MAX}  -- broker/affinity.py\n"
            f"local COUNT_DECAY = {COUNT_DECAY!r}  -- broker/affinity.py\n")


def _source(name: str) -> str:
    """A script with the final states and the shared functions of lua/_lib.lua in front
    (Redis scripts cannot import)."""
    return prelude() + _read("_lib") + "\n" + _read(name)


def register_script(redis: Redis, name: str) -> AsyncScript:
    """One script of lua/ (with the prelude and _lib.lua) on its own, for a store of its own."""
    return redis.register_script(_source(name))


@dataclass(frozen=True)
class Scripts:
    admit: AsyncScript
    room: AsyncScript  # admission's read-only hint: whether a call fits (admit.lua's refusal)
    start: AsyncScript
    lease: AsyncScript
    commit: AsyncScript
    cancel: AsyncScript
    dead_letter: AsyncScript
    reply: AsyncScript
    requeue: AsyncScript
    consumer_drop: AsyncScript
    dispatch: AsyncScript  # fair share: staged entries onto the lane, then a read (the fetch's)
    settle: AsyncScript  # fair share: a tenant's counter corrected at the final
    affinity_beat: AsyncScript  # prefix affinity: a worker's free slots; the owners' recompute (broker/affinity.py)
    affinity_owners: AsyncScript
    expire: AsyncScript  # the housekeeping sweep's (broker/housekeeping.py)
    deploy: AsyncScript  # model deployments (broker/registry.py)
    # bulk jobs (broker/jobs.py)
    job_refresh: AsyncScript
    job_release: AsyncScript
    job_move: AsyncScript
    job_cancel: AsyncScript
    job_put: AsyncScript

    @classmethod
    def register(cls, redis: Redis, *, pipelined: bool = False) -> Scripts:
        """`pipelined`: calls made in one turn of the event loop share one round trip (below);
        on a cluster each call goes alone (redis-py's cluster pipeline refuses scripts)."""
        scripts = cls(**{name: redis.register_script(_source(name)) for name in cls.__annotations__})
        if not pipelined or is_cluster(redis):
            return scripts
        calls = PipelinedCalls(redis)
        return dataclasses.replace(scripts, **{f.name: calls.bind(getattr(scripts, f.name))
                                               for f in dataclasses.fields(scripts)})


Call = tuple[AsyncScript, Sequence[object], Sequence[object], asyncio.Future]


class PipelinedCalls:
    """Script calls made in one turn of the event loop, sent as one pipeline of EVALSHAs: a worker
    starting or committing the requests of one read, or an api admitting the requests that
    arrived together, pays one round trip, not one each (redis-py's per-call overhead was a
    third of their CPU). Each call still runs as its own script, atomically, and answers (or
    raises) on its own; a NOSCRIPT (Redis restarted without them) loads the scripts and sends
    those calls again (none of them ran)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._pending: list[Call] = []
        self._sending: set[asyncio.Task] = set()

    def bind(self, script: AsyncScript) -> Callable[..., Awaitable[object]]:
        async def call(keys: Sequence[object] = (), args: Sequence[object] = ()) -> object:
            fut = asyncio.get_running_loop().create_future()
            self._pending.append((script, keys, args, fut))
            if len(self._pending) == 1:
                asyncio.get_running_loop().call_soon(self._send_pending)
            return await fut

        return call

    def _send_pending(self) -> None:
        calls, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[Call]) -> None:
        try:
            answers = await self._execute(calls)
        except BaseException as err:  # Redis away: every call of the pipeline fails as it would alone
            _settle(calls, [err] * len(calls))
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        unloaded = [i for i, a in enumerate(answers) if isinstance(a, NoScriptError)]
        _settle([c for i, c in enumerate(calls) if i not in unloaded],
                [a for i, a in enumerate(answers) if i not in unloaded])  # those ran: their answers now
        if unloaded:  # none of these ran: load the scripts and send them again
            again = [calls[i] for i in unloaded]
            try:
                for script in {c[0] for c in again}:
                    await self.redis.script_load(script.script)
                answers = await self._execute(again)
            except BaseException as err:
                _settle(again, [err] * len(again))
                if isinstance(err, asyncio.CancelledError):
                    raise
                return
            _settle(again, answers)

    async def _execute(self, calls: list[Call]) -> list[object]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return await pipe.execute(raise_on_error=False)


def _settle(calls: list[Call], answers: list[object]) -> None:
    for (*_, fut), answer in zip(calls, answers):
        if fut.done():  # its caller was cancelled
            continue
        if isinstance(answer, BaseException):
            fut.set_exception(answer)
        else:
            fut.set_result(answer)
