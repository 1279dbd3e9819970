"""The typed call of the replies wing's script (broker/plumbing/scripts.py: one frozen dataclass
per script, its KEYS then its ARGV in order, named as the script binds them)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.plumbing import CallPart, Counted, Key, Parts, ScriptCall


@dataclass(frozen=True)
class ReplyWrite(CallPart):
    """One request's token deltas in a reply.lua call, fenced on its own."""

    reply: Key
    status: Key
    fence: str  # the writer's fencing token
    reply_ttl: int  # 0: set already (unless a write creates the stream)
    deltas: Counted  # DeltaEvent JSON each


@dataclass(frozen=True)
class Reply(ScriptCall):
    """reply.lua: the token deltas of many requests of one slot (a flush of a worker)."""

    script = "reply"
    requests: Parts  # ReplyWrite each
