"""The typed calls of the delivery wing's scripts (broker/plumbing/scripts.py: one frozen dataclass
per script, its KEYS then its ARGV in order, named as the script binds them)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.plumbing import Key, ScriptCall


@dataclass(frozen=True)
class Start(ScriptCall):
    """start.lua: guard an entry and, where it runs, take a fresh fencing token."""

    script = "start"
    stream: Key
    status: Key
    cancel: Key
    reply: Key
    group: str
    consumer: str
    entry_id: str
    now: float
    deadline: float
    attempt: int
    status_ttl: int
    reply_ttl: int
    done_channel: str
    rid: str
    quarantined: int  # 1: a suspect run in a quarantine group of one (a crash then is its own)
    result_ttl: int
    nonce: str
