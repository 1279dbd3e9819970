"""A tenant's requests and tokens per minute at admission (broker/intake/quotas.py), and OpenAI's
`x-ratelimit-*` headers on every answer of a submitting route.

A call is charged once its rows are checked and its messages built, just before its admission:
one request, and each choice's prompt estimate plus max_tokens. Over a limit it is refused
with 429, `Retry-After` and an error naming the limit; a call whose admission is refused after
the charge (its queue full) is given back. OpenAI's limits are per model and most routes name
the model in the body, so the charge comes after the body (the key is checked before it, as
ever); a route naming it in its path looks first (`refuse_early`) and refuses before the body.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.errors import ApiError
from sluice.api.metrics import TENANT_REFUSED
from sluice.broker.intake.quotas import Bucket, Charge, Quotas, prompt_estimate
from sluice.config.model import ModelConfig
from sluice.config.tenants import Tenants
from sluice.protocol.messages import RequestMessage
from sluice.protocol.rows import prompt_text

# The x-ratelimit-* headers of the answer under way (set by RateLimitHeaders, filled by a charge).
_ANSWER_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("sluice_ratelimit_headers", default=None)

LIMIT_NAMES = {"requests": "requests_per_minute", "tokens": "tokens_per_minute",
               "tokens_call": "tokens_per_minute"}


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def ratelimit_headers(charge: Charge) -> dict[str, str]:
    """OpenAI's headers for each limit the tenant has (none for a limit it does not)."""
    headers: dict[str, str] = {}
    for name, bucket in (("requests", charge.requests), ("tokens", charge.tokens)):
        if bucket is not None:
            headers.update(_bucket_headers(name, bucket))
    return headers


def _bucket_headers(name: str, bucket: Bucket) -> dict[str, str]:
    return {f"x-ratelimit-limit-{name}": str(bucket.limit),
            f"x-ratelimit-remaining-{name}": str(bucket.remaining),
            f"x-ratelimit-reset-{name}": duration(bucket.reset_s)}


class RateLimitHeaders:
    """Plain ASGI: the x-ratelimit-* headers a charge made during the request go on its answer
    (success, refusal or stream alike)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        token = _ANSWER_HEADERS.set(headers)

        async def send_with(message: Message) -> None:
            if message["type"] == "http.response.start" and headers:
                present = {name.lower() for name, _ in message.get("headers", [])}
                message = {**message, "headers": [*message.get("headers", []),
                                                  *((k.encode(), v.encode()) for k, v in headers.items()
                                                    if k.encode() not in present)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with)
        finally:
            _ANSWER_HEADERS.reset(token)


class TenantLimits:
    def __init__(self, quotas: Quotas | None, tenants: Tenants) -> None:
        self.quotas = quotas
        self.tenants = tenants

    def _limits(self, tenant: str) -> tuple[int | None, int | None]:
        config = self.tenants.get(tenant)
        return config.requests_per_minute, config.tokens_per_minute

    async def charge(self, model: ModelConfig, messages: Sequence[RequestMessage]) -> bool:
        """Charge the call (its messages share a tenant) or raise the 429; whether it was charged."""
        tenant = messages[0].tenant
        rpm, tpm = self._limits(tenant)
        if self.quotas is None or not (rpm or tpm):
            return False
        tokens = [sum(prompt_estimate(prompt_text(row)) + int(row.get("max_tokens") or 0) for row in m.rows)
                  for m in messages]
        charge = await self.quotas.charge(model.name, [m.id for m in messages], tokens, tenant,
                                          requests_per_minute=rpm, tokens_per_minute=tpm, shards=model.shards)
        headers = ratelimit_headers(charge)
        answer = _ANSWER_HEADERS.get()
        if answer is not None:
            answer.update(headers)
        if not charge.refused:
            return True
        limit = LIMIT_NAMES[charge.refused]
        TENANT_REFUSED.labels(tenant, limit).inc(len(messages))
        configured = rpm if charge.refused == "requests" else tpm
        if charge.refused == "tokens_call":
            message = (f"tenant {tenant!r}: this call needs about {sum(tokens)} tokens (prompt + "
                       f"max_tokens), more than its tokens_per_minute limit ({configured}) allows at once: "
                       "lower max_tokens or n")
        else:
            message = (f"tenant {tenant!r} is over its {limit} limit ({configured}) on model {model.name!r}: "
                       f"retry in {duration(charge.retry_after_s)}")
        raise ApiError(429, message, code="rate_limit_exceeded",
                       headers={**headers, "Retry-After": str(max(1, math.ceil(charge.retry_after_s)))})

    async def refuse_early(self, model: ModelConfig, tenant: str) -> None:
        """Before a call's body is read, where its route names the model: a 429 when the tenant
        has no request left on it now (a look; the charge after the body still decides)."""
        rpm, _ = self._limits(tenant)
        if self.quotas is None or not rpm:
            return
        wait_s = await self.quotas.requests_wait_s(model.name, tenant, requests_per_minute=rpm,
                                                   shards=model.shards)
        if wait_s > 0:
            TENANT_REFUSED.labels(tenant, "requests_per_minute").inc()
            raise ApiError(429, f"tenant {tenant!r} is over its requests_per_minute limit ({rpm}) on model "
                                f"{model.name!r}: retry in {duration(wait_s)}", code="rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, math.ceil(wait_s)))})

    async def release(self, model: ModelConfig, messages: Sequence[RequestMessage]) -> None:
        """Give back a charged call that was not admitted after all."""
        assert self.quotas is not None
        rpm, _ = self._limits(messages[0].tenant)
        await self.quotas.release(model.name, [m.id for m in messages], messages[0].tenant,
                                  requests_per_minute=rpm, shards=model.shards)
