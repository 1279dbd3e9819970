"""The typed calls of the delivery wing's scripts (broker/plumbing/scripts.py: one frozen dataclass
per script, its KEYS then its ARGV in order, named as the script binds them)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.plumbing import Counted, Key, KeyList, ScriptCall, Spread


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


@dataclass(frozen=True)
class Lease(ScriptCall):
    """lease.lua: keep the entries this consumer holds; answers those it lost."""

    script = "lease"
    stream: Key
    group: str
    consumer: str
    entry_ids: Spread


@dataclass(frozen=True)
class Commit(ScriptCall):
    """commit.lua: the last deltas, the final, the status, XACK and XDEL at once, unless fenced."""

    script = "commit"
    stream: Key
    status: Key
    reply: Key
    group: str
    consumer: str
    entry_id: str
    state: str
    final: str  # the FinalResult's JSON
    now: float
    result_ttl: int
    reply_ttl: int
    done_channel: str
    rid: str
    rows: int  # the request's row count
    counts: Counted  # per row, the tokens the worker sent to the reply stream (none: not checked)
    fence: str  # the fencing token of the worker's start
    deltas: Spread  # the deltas to write first (JSON, as reply.lua's)


@dataclass(frozen=True)
class DeadLetter(ScriptCall):
    """dead_letter.lua: move an entry to the dead-letter stream and tell its client it failed."""

    script = "dead_letter"
    stream: Key
    dlq: Key
    status: Key
    reply: Key
    group: str
    consumer: str
    entry_id: str
    rid: str
    data: str  # the entry's payload, kept as it was
    err: str
    attempts: int
    now: float
    result_ttl: int
    reply_ttl: int
    done_channel: str
    dlq_max_len: int
    # the request's, for a status that expired meanwhile ('' where unknown: an unreadable entry)
    model: str
    lane: str
    owner: str
    enqueued_at: float | str
    hook: str  # '1': its owner has a webhook endpoint


@dataclass(frozen=True)
class Requeue(ScriptCall):
    """requeue.lua: put a dead letter back on its stream, within the stream's bound."""

    script = "requeue"
    stream: Key
    status: Key
    reply: Key
    dlq: Key
    other: Key  # the other lane's stream
    max_queued: int
    rid: str
    data: str
    now: float
    status_ttl: int
    letter: str  # the dead letter's entry id
    lane_max: int
    model: str
    lane: str
    owner: str  # '' for none
    retain_s: int
    nonce: str  # this call's own: a re-sent call is told the entry its first run put back


@dataclass(frozen=True)
class ConsumerDrop(ScriptCall):
    """consumer_drop.lua: remove a dead worker's consumer holding nothing from a shard's streams."""

    script = "consumer_drop"
    name_lock: Key
    streams: KeyList
    group: str
    consumer: str


@dataclass(frozen=True)
class Dispatch(ScriptCall):
    """dispatch.lua: staged requests onto the lane in fair order, then this consumer's read."""

    script = "dispatch"
    stream: Key
    consumer: str
    count: int
    reserve: int  # the tenant reserve: free slots kept for a tenant running less than its part
    capacity: int
    now: float
    wait_ms: int | str  # '': not placing by prefix
    live_ms: int
    window: int
    running: Spread  # tenant, how many of its requests this worker holds, ...


@dataclass(frozen=True)
class Settle(ScriptCall):
    """settle.lua: correct a tenant's virtual token counter by what its request really cost."""

    script = "settle"
    status: Key
    actual: int
    stream: str  # the lane the request ran on


@dataclass(frozen=True)
class AffinityBeat(ScriptCall):
    """affinity_beat.lua: a worker's free slots recorded; now and then, what owners come from."""

    script = "affinity_beat"
    tag: Key  # the interactive lane stream (its tag names the affinity keys)
    consumer: str
    free: int  # -1: the worker leaves
    live_ms: int
    interval_ms: int  # 0: no recompute


@dataclass(frozen=True)
class AffinityOwners(ScriptCall):
    """affinity_owners.lua: the owners table replaced by the groups' owners."""

    script = "affinity_owners"
    owners: Key  # the interactive lane stream (its tag names the owners table)
    ttl_ms: int
    groups: Spread  # group, its owners (comma-separated, best first), ...


@dataclass(frozen=True)
class Expire(ScriptCall):
    """expire.lua: end `expired` an entry past its deadline that no worker will start in time."""

    script = "expire"
    stream: Key
    status: Key
    reply: Key
    group: str
    entry_id: str
    now: float
    deadline: float
    lease_ms: int
    result_ttl: int
    reply_ttl: int
    channel: str
    rid: str
