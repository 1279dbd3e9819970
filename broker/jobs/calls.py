"""The typed calls of the jobs wing's scripts (broker/plumbing/scripts.py: one frozen dataclass
per script, its KEYS then its ARGV in order, named as the script binds them)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.plumbing import CallPart, Key, Parts, ScriptCall


@dataclass(frozen=True)
class JobRefresh(ScriptCall):
    """job_refresh.lua: keep a job's lock for another TTL, only for the runner holding it."""

    script = "job_refresh"
    lock: Key
    token: str
    ttl_ms: int


@dataclass(frozen=True)
class JobRelease(ScriptCall):
    """job_release.lua: release a job's lock, only by the runner holding it."""

    script = "job_release"
    lock: Key
    token: str


@dataclass(frozen=True)
class HashField(CallPart):
    """A field of a hash and its value, as a script sets it (job_move.lua)."""

    field: str
    value: str


@dataclass(frozen=True)
class JobMove(ScriptCall):
    """job_move.lua: move a batch to `to` when its status is an expected one (and, with a token,
    only while that token holds its lock)."""

    script = "job_move"
    batch: Key
    lock: Key
    out: Key
    rids: Key
    to: str
    expected_statuses: str  # space-separated
    token: str  # '' for none (the api's moves)
    now: int
    retention: int  # s
    result_retention: int  # s
    fields: Parts  # HashField each: set with the move


@dataclass(frozen=True)
class JobCancel(ScriptCall):
    """job_cancel.lua: cancel a batch (`cancelling` while a runner has it)."""

    script = "job_cancel"
    batch: Key
    lock: Key
    now: int
    retention: int  # s, of a batch cancelled at once


@dataclass(frozen=True)
class Increment(CallPart):
    """A counter of the batch and what to add to it (job_put.lua)."""

    counter: str
    by: int


@dataclass(frozen=True)
class JobPut(ScriptCall):
    """job_put.lua: write one field of a job once, and count it, while the token holds its lock."""

    script = "job_put"
    lock: Key
    hash: Key
    batch: Key
    token: str
    field: str
    value: str
    ttl: int  # s
    counters: Parts  # Increment each


@dataclass(frozen=True)
class TenantFile(ScriptCall):
    """tenant_file.lua: record one more stored file of a tenant, unless past its limits."""

    script = "tenant_file"
    key: Key  # the tenant's files hash
    file_id: str
    size: int
    expires_at: int  # s
    max_files: int  # 0: none
    max_bytes: int  # 0: none
