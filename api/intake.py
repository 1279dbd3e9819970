"""Admitting requests: rows checked, messages built (seed, deadline, owner), one admission."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from pydantic import ConfigDict

from sluice.api.errors import ApiError
from sluice.api.metrics import ADMITTED, REJECTED, TENANT_ADMITTED, TENANT_REFUSED
from sluice.api.rows import RowsRefused, checked_rows, prompt_text, where
from sluice.api.schemas import CallOptions
from sluice.api.slo import SloBounds
from sluice.api.tenant_limits import TenantLimits
from sluice.broker.intake.admission import Admission, NotDurable, QueueFull, SloRefused, TenantQueueFull
from sluice.broker.limits import TenantShare
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.config.tenants import DEFAULT_TENANT
from sluice.protocol.ids import new_request_id, request_shard
from sluice.protocol.messages import Lane, RequestMessage, Sampled, SamplingSpec, StructuredSpec
from sluice.protocol.rows import INT32_MAX, sampling_problem
from sluice.protocol.tokens import Measured, PromptLimits

Rows = Sequence[Mapping[str, Any]]
CHUNK = 64  # rows checked, or messages built, between two turns of the event loop


class Sampling(CallOptions, Sampled):
    """What a caller chose about sampling and time; the rest comes from the deployment. The
    sampling fields are declared once (protocol/messages.py), as the native routes take them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None
    # vLLM's request priority, lower first: above 0 it waits in the bulk lane (its own share
    # of the queue bound, never the slots a worker keeps for interactive work).
    priority: int = 0

    def spec(self, max_tokens: int, seed: int) -> SamplingSpec:
        """The entry's sampling: these choices (those SamplingSpec has), the row's token budget
        and the seed."""
        chosen = {name: getattr(self, name) for name in type(self).model_fields
                  if name in SamplingSpec.model_fields}
        return SamplingSpec.model_validate({**chosen, "max_tokens": max_tokens, "seed": seed})


class _Bound(TypedDict):
    """The bound an admission is held to (Admission.submit's and submit_many's keywords)."""

    max_queued: int
    shards: int
    keyed: bool
    result_ttl_s: int | None
    share: TenantShare
    slo_max: int | None


def pick_shard(model: ModelConfig, priority: int = 0) -> int:
    """Where a new request of `model` goes: a shard drawn at random when the model is sharded
    and the request is interactive (the bulk lane is shard 0's)."""
    return random.randrange(model.shards) if model.shards > 1 and priority <= 0 else 0


def request_id(model: ModelConfig, priority: int = 0) -> str:
    return new_request_id(pick_shard(model, priority))


class Intake:
    def __init__(self, settings: Settings, admission: Admission, prompt_limits: PromptLimits,
                 slo: SloBounds | None = None, tenant_limits: TenantLimits | None = None) -> None:
        self.settings = settings
        self.admission = admission
        self.prompt_limits = prompt_limits
        self.slo = slo
        self.tenant_limits = tenant_limits  # tenants' requests and tokens per minute

    async def enqueue(self, model: ModelConfig, rows: Rows, sampling: Sampling = Sampling(), *,
                      rid: str | None = None, owner: str | None = None, keyed: bool = False,
                      tenant: str = DEFAULT_TENANT) -> RequestMessage:
        """Admit one request of `rows` for `model` (503 with Retry-After when its queue is full).
        `owner`: the digest of the api key that made it (recorded in its status hash), `tenant`
        that key's tenant (429 over its limits). `keyed`: an Idempotency-Key names it (its
        admission leaves a mark that outlives its result)."""
        (message,) = await self.enqueue_many(model, [rows], sampling, rids=[rid] if rid else None,
                                             owner=owner, keyed=keyed, tenant=tenant)
        return message

    async def enqueue_many(self, model: ModelConfig, requests: Sequence[Rows],
                           sampling: Sampling = Sampling(), *, rids: list[str] | None = None,
                           owner: str | None = None, keyed: bool = False,
                           tenant: str = DEFAULT_TENANT) -> list[RequestMessage]:
        """Admit several requests (each a list of rows; the choices of one completion call)
        all at once or none of them: one admission against the queue bound, so a call is never
        left half-admitted and never counted one by one. Request i gets seed + i.

        A call's cost is bounded before any per-row work: at most max_choices_per_call
        requests (413), and a call of more than one row is first checked against the queue
        bound by one read-only script (503 at once when it cannot fit). The rows are then checked and the
        messages built a chunk at a time, giving the event loop back between chunks."""
        self.check_call_size(len(requests), "prompt")
        await self._check_sampling(model, sampling)
        lane: Lane = "bulk" if sampling.priority > 0 else "interactive"
        # One call: one shard.
        shard = request_shard(rids[0]) if rids else pick_shard(model, sampling.priority)
        max_queued = model.max_queued or self.settings.max_queued
        config = self.tenant_limits.tenants.get(tenant) if self.tenant_limits else None  # its fair share
        share = TenantShare(config.weight, config.queue_share) if config else TenantShare()
        # ('share' is left to the admission itself: its 429 names the tenant's share)
        if sum(len(rows) for rows in requests) > 1 and await self.admission.refusal(
                model.name, shard, lane, len(requests), max_queued=max_queued, shards=model.shards,
                tenant=tenant, share=share) == "bound":
            raise self._queue_full(model, len(requests))
        checked, firsts = await self._checked_call(model, requests, sampling.min_tokens)
        now = time.time()
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)
        timeout_s = sampling.timeout_s or model.request_timeout_s or self.settings.request_timeout_s
        messages = []
        for i, rows in enumerate(checked):
            if i and i % CHUNK == 0:
                await asyncio.sleep(0)
            messages.append(RequestMessage(
                id=rids[i] if rids else new_request_id(shard),
                model=model.name,
                rows=rows,
                sampling=sampling.spec(rows[0]["max_tokens"], seed + i),
                enqueued_at=now,
                deadline=now + timeout_s,
                owner=owner,
                tenant=tenant,
                priority=sampling.priority,
                lane=lane,
                prefix=list(firsts[i].prefix),
                prefix_tokens=firsts[i].tokens,
            ))
        slo = await self.slo.bound(model) if self.slo and messages[0].lane == "interactive" else None
        bound = _Bound(max_queued=max_queued, shards=model.shards, keyed=keyed,
                       result_ttl_s=model.result_ttl_s or self.settings.result_ttl_s, share=share,
                       slo_max=slo.max_in_lane if slo is not None else None)
        charged = await self.tenant_limits.charge(model, messages) if self.tenant_limits else False
        try:
            if len(messages) == 1:
                await self.admission.submit(messages[0], **bound)
            else:
                await self.admission.submit_many(messages, **bound)
        except SloRefused as refused:
            assert slo is not None and model.slo is not None
            await self._give_back(charged, model, messages)
            REJECTED.labels(model.name, "slo").inc(len(messages))
            retry_after_s = slo.retry_after_s(refused.depth, len(messages))
            raise ApiError(503, f"model {model.name!r} cannot start this request within its "
                                f"time-to-first-token target ({model.slo.ttft_ms:g} ms, slo.ttft_ms): "
                                f"{refused.depth} requests are ahead of it and its workers finish about "
                                f"{slo.rate:.1f}/s; retry later",
                           code="overloaded", headers={"Retry-After": str(retry_after_s)}) from None
        except TenantQueueFull as full:  # over its share of the queue while others wait: the tenant's limit
            await self._give_back(charged, model, messages)
            TENANT_REFUSED.labels(tenant, "queue_share").inc(len(messages))
            raise ApiError(429, f"tenant {tenant!r} holds its share of model {model.name!r}'s queue "
                                f"({full.held} requests) while other tenants have work queued; retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except QueueFull:
            await self._give_back(charged, model, messages)
            TENANT_REFUSED.labels(tenant, "queue_full").inc(len(messages))
            raise self._queue_full(model, len(messages)) from None
        except NotDurable as err:  # strict durability: not known to be on disk, so not accepted
            raise ApiError(503, f"{err}; retry with the same Idempotency-Key", code="not_durable",
                           headers={"Retry-After": "1"}) from None
        ADMITTED.labels(model.name, messages[0].lane).inc(len(messages))
        TENANT_ADMITTED.labels(tenant, model.name).inc(len(messages))
        return messages

    async def _give_back(self, charged: bool, model: ModelConfig, messages: list[RequestMessage]) -> None:
        """A call charged to its tenant's limits and then refused admission is given back."""
        if charged and self.tenant_limits:
            await self.tenant_limits.release(model, messages)

    def check_call_size(self, count: int, param: str) -> None:
        """413 when one call asks for more than max_choices_per_call requests (prompts × n)."""
        cap = self.settings.max_choices_per_call
        if count > cap:
            raise ApiError(413, f"{param}: {count} choices (prompts × n) in one call; at most {cap} "
                                f"(SLUICE_MAX_CHOICES_PER_CALL)", param=param, code="request_too_large")

    @staticmethod
    def _queue_full(model: ModelConfig, count: int) -> ApiError:
        REJECTED.labels(model.name, "queue_full").inc(count)
        return ApiError(503, f"model {model.name!r} is saturated: its queue is full, retry later",
                        code="overloaded", headers={"Retry-After": "1"})

    async def _check_sampling(self, model: ModelConfig, sampling: Sampling) -> None:
        """A 400 naming the field for a value the engine would refuse (it would fail the request
        later, top_k 10^30 with an empty message): protocol/rows.py's checks, with the model's
        vocabulary when the api can read its tokenizer (read off the event loop). min_tokens is
        checked against each row's max_tokens once the rows are (`_checked_call`)."""
        loaded = await self.prompt_limits.load(model)
        vocab = loaded[0].get_vocab_size() if loaded else None
        asked = {"top_k": sampling.top_k, "stop_token_ids": sampling.stop_token_ids}
        problem = sampling_problem(model, asked, INT32_MAX, vocab)
        if problem:
            raise ApiError(problem.status, problem.message, param=problem.param)

    async def _checked_call(self, model: ModelConfig, requests: Sequence[Rows], min_tokens: int = 0
                            ) -> tuple[list[list[dict[str, Any]]], list[Measured]]:
        """Every request's rows checked, a chunk of rows at a time, and each request's first row
        as measured (its prefix key); a prompt repeated in the call (its n choices) is measured once."""
        known: dict[tuple[str, int], Measured] = {}
        checked, firsts, since_yield = [], [], 0
        for rows in requests:
            measured = await self._checked(model, rows, known)
            checked.append(measured[0])
            firsts.append(measured[1])
            for i, row in enumerate(checked[-1]):
                problem = sampling_problem(model, {"min_tokens": min_tokens}, row["max_tokens"], None)
                if problem:
                    raise ApiError(problem.status, problem.message.replace(
                        "max_tokens (", f"{where('max_tokens', i, len(rows))} (", 1), param=problem.param)
            since_yield += len(rows)
            if since_yield >= CHUNK:
                since_yield = 0
                await asyncio.sleep(0)
        return checked, firsts

    async def _checked(self, model: ModelConfig, rows: Rows,
                       known: dict[tuple[str, int], Measured]) -> tuple[list[dict[str, Any]], Measured]:
        """The rows checked, and the first as measured (its prefix key: the engine's batch starts with it)."""
        try:
            checked = checked_rows(model, rows, max_prompt_chars=self.settings.max_prompt_chars)
        except RowsRefused as refused:
            REJECTED.labels(model.name, refused.reason).inc()
            raise
        first = Measured()
        for i, row in enumerate(checked):
            key = (_measured_as(row), row["max_tokens"])
            if key not in known:
                known[key] = await self.prompt_limits.measure(model, row, row["max_tokens"])
            too_long = known[key].problem
            if too_long:
                REJECTED.labels(model.name, "context").inc()
                raise ApiError(400, where(too_long, i, len(checked)), param="prompt")
            if i == 0:
                first = known[key]
        return checked, first


def _measured_as(row: Mapping[str, Any]) -> str:
    """What makes two rows measure the same: the prompt, or the messages and tools the chat
    template renders (two chats with the same contents may differ in roles)."""
    if row.get("prompt") or "messages" not in row:
        return prompt_text(row)
    return json.dumps([row["messages"], row.get("tools")], sort_keys=True, default=str)
