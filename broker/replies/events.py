"""Reading reply streams: what a row's stream holds (a retry resumes after it), a stream's
entries as events with each token once, the final from the status hash, and where a resumed
reader (SSE Last-Event-ID) goes on."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing import stream_entries
from sluice.protocol.messages import DeltaEvent, FinalResult, TokenLogprob
from sluice.protocol.states import FINAL_STATES


@dataclass
class Delivered:
    """What one row's reply stream already holds: a retry continues after it."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


async def delivered(redis: Redis, model: str, rid: str) -> dict[int, Delivered]:
    """Per row, the tokens on the reply stream, contiguous from index 0 (every attempt resumed
    from the one before, so they form one sequence; an overlap or a gap ends it)."""
    rows: dict[int, Delivered] = {}
    after = "-"
    while True:
        got = stream_entries(await redis.xrange(ModelKeys(model).reply(rid), min=after, count=1000))
        for entry_id, fields in got:
            after = f"({entry_id}"
            if fields.get("kind") != "delta":
                continue
            ev = DeltaEvent.model_validate_json(fields["data"])
            row = rows.setdefault(ev.row, Delivered())
            if row.finish is None and ev.i == len(row.token_ids):
                row.token_ids.extend(ev.token_ids)
                row.text.append(ev.text)
                row.finish = ev.finish
                row.logprobs.extend(ev.logprobs or ())
                if ev.prompt_logprobs is not None:
                    row.prompt_logprobs = ev.prompt_logprobs
        if len(got) < 1000:
            return rows


@dataclass
class ReplyEvent:
    entry_id: str
    kind: str  # "delta" | "final"
    delta: DeltaEvent | None = None
    final: FinalResult | None = None


class ReplyDecoder:
    """A reply stream's entries as events, each token once: per row, the next token index not
    yet delivered. A delta overlapping tokens already delivered is skipped whole: its text cannot
    be split per token, and a retried structured attempt that replays them writes only past them,
    having checked that it regenerated the very tokens (or it fails: workers/generation.py)."""

    def __init__(self, next_index: int = 0) -> None:
        self.seen = {0: next_index}

    def event(self, entry_id: str, fields: dict[str, str]) -> ReplyEvent | None:
        if fields.get("kind") == "final":
            return ReplyEvent(entry_id, "final", final=FinalResult.model_validate_json(fields["data"]))
        ev = DeltaEvent.model_validate_json(fields["data"])
        if ev.i < self.seen.get(ev.row, 0):
            return None
        self.seen[ev.row] = ev.i + len(ev.token_ids)
        return ReplyEvent(entry_id, "delta", delta=ev)


async def final_status(redis: Redis, status_key: str) -> FinalResult | None:
    """The request's final result from its status hash, or None while it has none."""
    state, result = await redis.hmget(status_key, ["state", "result"])
    return FinalResult.model_validate_json(result) if state in FINAL_STATES and result else None


_ENTRY_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")


async def resume_index(redis: Redis, model: str, rid: str, last_id: str) -> dict[int, int]:
    """Per row, the next token index to show a reader that got every event up to reply entry
    `last_id` (SSE Last-Event-ID): the stream up to that entry read through the decoder a
    reader from the start used, so a resumed reader sees exactly the rest, for every row.

    Raises ValueError when `last_id` is not a stream entry id (a client's header, unchecked).
    """
    if not _ENTRY_ID.fullmatch(last_id) or any(int(n) >= 2**64 for n in last_id.split("-")):
        raise ValueError(f"{last_id!r} is not a stream entry id")
    key = ModelKeys(model).reply(rid)
    decoder, start = ReplyDecoder(), "-"
    while True:
        got = stream_entries(await redis.xrange(key, min=start, max=last_id, count=1000))
        for entry_id, fields in got:
            decoder.event(entry_id, fields)
            start = f"({entry_id}"
        if len(got) < 1000:
            return decoder.seen
