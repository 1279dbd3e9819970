"""Admitting requests: rows checked, messages built (seed, deadline, owner), one admission."""

from __future__ import annotations

import dataclasses
import random
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.api.errors import ApiError
from sluice.api.metrics import ADMITTED, REJECTED
from sluice.api.rows import RowsRefused, checked_rows, prompt_text, where
from sluice.api.slo import SloBounds
from sluice.api.tokens import PromptLimits
from sluice.broker.admission import Admission, NotDurable, QueueFull, SloRefused
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.ids import new_request_id
from sluice.protocol.messages import RequestMessage, SamplingSpec, StructuredSpec

Rows = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Sampling:
    """What a caller chose about sampling and time; the rest comes from the deployment."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: a fresh one, so that every request has a seed to retry with
    timeout_s: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None
    # vLLM's request priority, lower first: above 0 it waits in the bulk lane (its own share
    # of the queue bound, never the slots a worker keeps for interactive work).
    priority: int = 0

    def spec(self, max_tokens: int, seed: int) -> SamplingSpec:
        """The entry's sampling: these choices (those SamplingSpec has), the row's token budget
        and the seed."""
        names = [f.name for f in dataclasses.fields(self) if f.name in SamplingSpec.model_fields]
        chosen = {name: getattr(self, name) for name in names}
        return SamplingSpec.model_validate({**chosen, "max_tokens": max_tokens, "seed": seed})


def pick_shard(model: ModelConfig, priority: int = 0) -> int:
    """Where a new request of `model` goes: a shard drawn at random when the model is sharded
    and the request is interactive (the bulk lane is shard 0's)."""
    return random.randrange(model.shards) if model.shards > 1 and priority <= 0 else 0


def request_id(model: ModelConfig, priority: int = 0) -> str:
    return new_request_id(pick_shard(model, priority))


class Intake:
    def __init__(self, settings: Settings, admission: Admission, prompt_limits: PromptLimits,
                 slo: SloBounds | None = None) -> None:
        self.settings = settings
        self.admission = admission
        self.prompt_limits = prompt_limits
        self.slo = slo

    async def enqueue(self, model: ModelConfig, rows: Rows, sampling: Sampling = Sampling(), *,
                      rid: str | None = None, owner: str | None = None, keyed: bool = False) -> RequestMessage:
        """Admit one request of `rows` for `model` (503 with Retry-After when its queue is full).
        `owner`: the digest of the api key that made it (recorded in its status hash). `keyed`: an
        Idempotency-Key names it (its admission leaves a mark that outlives its result)."""
        (message,) = await self.enqueue_many(model, [rows], sampling, rids=[rid] if rid else None, owner=owner,
                                             keyed=keyed)
        return message

    async def enqueue_many(self, model: ModelConfig, requests: Sequence[Rows], sampling: Sampling = Sampling(), *,
                           rids: list[str] | None = None, owner: str | None = None,
                           keyed: bool = False) -> list[RequestMessage]:
        """Admit several requests (each a list of rows; the choices of one completion call)
        all at once or none of them: one admission against the queue bound, so a call is never
        left half-admitted and never counted one by one. Request i gets seed + i."""
        checked = [await self._checked(model, rows) for rows in requests]
        now = time.time()
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)
        timeout_s = sampling.timeout_s or model.request_timeout_s or self.settings.request_timeout_s
        shard = pick_shard(model, sampling.priority)  # one call's requests: one shard
        messages = [RequestMessage(
            id=rids[i] if rids else new_request_id(shard),
            model=model.name,
            rows=rows,
            sampling=sampling.spec(rows[0]["max_tokens"], seed + i),
            enqueued_at=now,
            deadline=now + timeout_s,
            owner=owner,
            priority=sampling.priority,
            lane="bulk" if sampling.priority > 0 else "interactive",
        ) for i, rows in enumerate(checked)]
        bound = {"max_queued": model.max_queued or self.settings.max_queued, "shards": model.shards,
                 "result_ttl_s": model.result_ttl_s or self.settings.result_ttl_s, "keyed": keyed}
        slo = await self.slo.bound(model) if self.slo and messages[0].lane == "interactive" else None
        if slo is not None:
            bound["slo_max"] = slo.max_in_lane
        try:
            if len(messages) == 1:
                await self.admission.submit(messages[0], **bound)
            else:
                await self.admission.submit_many(messages, **bound)
        except SloRefused as refused:
            assert slo is not None and model.slo is not None
            REJECTED.labels(model.name, "slo").inc(len(messages))
            raise ApiError(503, f"model {model.name!r} cannot start this request within its time-to-first-token "
                                f"target ({model.slo.ttft_ms:g} ms, slo.ttft_ms): {refused.depth} requests are ahead "
                                f"of it and its workers finish about {slo.rate:.1f}/s; retry later",
                           code="overloaded", headers={"Retry-After": str(slo.retry_after_s(refused.depth,
                                                                                         len(messages)))}) from None
        except QueueFull:
            REJECTED.labels(model.name, "queue_full").inc(len(messages))
            raise ApiError(503, f"model {model.name!r} is saturated: its queue is full, retry later",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        except NotDurable as err:  # strict durability: not known to be on disk, so not accepted
            raise ApiError(503, f"{err}; retry with the same Idempotency-Key", code="not_durable",
                           headers={"Retry-After": "1"}) from None
        ADMITTED.labels(model.name, messages[0].lane).inc(len(messages))
        return messages

    async def _checked(self, model: ModelConfig, rows: Rows) -> list[dict[str, Any]]:
        try:
            checked = checked_rows(model, rows, max_prompt_chars=self.settings.max_prompt_chars)
        except RowsRefused as refused:
            REJECTED.labels(model.name, refused.reason).inc()
            raise
        for i, row in enumerate(checked):
            too_long = await self.prompt_limits.check(model, prompt_text(row), row["max_tokens"])
            if too_long:
                REJECTED.labels(model.name, "context").inc()
                raise ApiError(400, where(too_long, i, len(checked)), param="prompt")
        return checked
