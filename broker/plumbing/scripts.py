"""The one loader of the Lua scripts that make each broker change atomic, and their typed calls.

Each script is called through one frozen dataclass, a ScriptCall kept in the wing that uses the
script (`delivery/calls.py`, ...): its fields are the script's KEYS, then its ARGV, in order, named
as the script's `local ... = KEYS[n]` / `ARGV[n]` bindings (tests/broker/test_script_calls.py holds
them to the Lua). No call site assembles a key or argument list."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import typing
from collections.abc import Awaitable, Callable, Iterable, Sequence
from importlib import resources
from typing import Annotated, Any, ClassVar

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from sluice.broker import keys
from sluice.broker.plumbing.connection import is_cluster
from sluice.protocol.states import FINAL_BATCH_STATES, FINAL_STATES

# How a field of a ScriptCall goes into the call (its annotation's metadata):
Key = Annotated[str, "key"]  # one of KEYS
KeyList = Annotated[tuple[str, ...], "keys"]  # several of KEYS, in order
Counted = Annotated[tuple[object, ...], "counted"]  # in ARGV: how many, then each
Spread = Annotated[tuple[object, ...], "spread"]  # in ARGV: each (the last field)


class CallPart:
    """Fields laid out as a script takes them (ScriptCall's), for a part of a call that carries
    many of its kind: one request's KEYS and ARGV in reply.lua's, one request's ARGV in admit.lua's.
    A ScriptCall holds them in a `Parts` field."""

    @classmethod
    @functools.cache
    def layout(cls) -> tuple[tuple[str, str], ...]:
        """(field, how) per field, in order: how is "key", "keys", "counted", "spread", "parts"
        or "arg"."""
        hints = typing.get_type_hints(cls, include_extras=True)
        return tuple((f.name, getattr(hints[f.name], "__metadata__", ("arg",))[0])
                     for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def keys_and_args(self) -> tuple[list[str], list[EncodableT]]:
        keys: list[str] = []
        args: list[EncodableT] = []
        for name, how in self.layout():
            value = getattr(self, name)
            if how == "key":
                keys.append(value)
            elif how == "keys":
                keys.extend(value)
            elif how == "counted":
                args += [len(value), *value]
            elif how == "spread":
                args.extend(value)
            elif how == "parts":
                for part in value:
                    part_keys, part_args = part.keys_and_args()
                    keys += part_keys
                    args += part_args
            else:
                args.append(value)
        return keys, args


Parts = Annotated[tuple[CallPart, ...], "parts"]  # each part's KEYS and ARGV, part by part (the last field)


class ScriptCall(CallPart):
    """A call of lua/<script>.lua. Subclasses are frozen dataclasses whose fields are its KEYS
    (annotated Key or KeyList), then its ARGV (plain fields, or Counted and Spread tuples), or
    its parts (Parts)."""

    script: ClassVar[str]


def _read(name: str) -> str:
    return resources.files("sluice.broker").joinpath(f"lua/{name}.lua").read_text()


def _lua_set(states: Iterable[enum.Enum]) -> str:
    return "{" + ", ".join(f"['{s.value}'] = true" for s in sorted(states, key=lambda s: s.value)) + "}"


def prelude() -> str:
    """What every script shares with the Python side, defined once: protocol/states.py's final
    states as the Lua tables that lua/_lib.lua's is_final_state (a request) and job_move.lua (a
    batch) ask, and the figures and key suffixes of broker/keys.py (a script builds a key it is not
    handed as `tag .. SUFFIX.held`)."""
    suffixes = ", ".join(f"{suffix.name.lower()} = '{suffix.value}'" for suffix in keys.Suffix)
    return (f"local FINAL_STATES = {_lua_set(FINAL_STATES)}  -- protocol/states.py\n"
            f"local BATCH_FINAL = {_lua_set(FINAL_BATCH_STATES)}  -- protocol/states.py\n"
            f"local OUTBOX_MAX_LEN = {keys.OUTBOX_MAX_LEN}  -- broker/keys.py\n"
            f"local GROUP = '{keys.GROUP}'  -- broker/keys.py\n"
            f"local VTC_TTL_S = {keys.VTC_TTL_S}  -- broker/keys.py\n"
            f"local ACTIVE_S = {keys.ACTIVE_S}  -- broker/keys.py\n"
            f"local AFFINITY_GROUPS_MAX = {keys.AFFINITY_GROUPS_MAX}  -- broker/keys.py\n"
            f"local COUNT_DECAY = {keys.COUNT_DECAY!r}  -- broker/keys.py\n"
            f"local SUFFIX = {{{suffixes}}}  -- broker/keys.py Suffix\n")


def source(name: str) -> str:
    """A script with the prelude and the shared functions of lua/_lib.lua in front (Redis
    scripts cannot import)."""
    return prelude() + _read("_lib") + "\n" + _read(name)


class Scripts:
    """Every script of lua/, loaded one way, for one client: `await scripts(call)` runs the
    script `call` names, with the keys and arguments its fields hold (redis-py's script object:
    EVALSHA, loading the script where Redis lacks it).

    `pipelined`: calls made in one turn of the event loop share one round trip (PipelinedCalls);
    on a cluster each call goes alone (redis-py's cluster pipeline refuses scripts)."""

    def __init__(self, redis: Redis, *, pipelined: bool = False) -> None:
        self.redis = redis
        self.pipelined = PipelinedCalls(redis) if pipelined and not is_cluster(redis) else None
        self._scripts: dict[str, AsyncScript] = {}
        self._calls: dict[str, Callable[..., Awaitable[Any]]] = {}

    def script(self, name: str) -> AsyncScript:
        """lua/<name>.lua, registered on this client (once)."""
        if name not in self._scripts:
            self._scripts[name] = self.redis.register_script(source(name))
        return self._scripts[name]

    async def __call__(self, call: ScriptCall) -> Any:
        keys, args = call.keys_and_args()
        run = self._calls.get(call.script)
        if run is None:
            script = self.script(call.script)
            # (on this client: a script object calls the one that registered it, which a client
            # wrapping another, as tests do, would pass over)
            run = self._calls[call.script] = (self.pipelined.bind(script) if self.pipelined
                                              else functools.partial(script, client=self.redis))
        return await run(keys=keys, args=args)


Call = tuple[AsyncScript, Sequence[EncodableT], Sequence[EncodableT], asyncio.Future]


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
        async def call(keys: Sequence[EncodableT] = (), args: Sequence[EncodableT] = ()) -> object:
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
