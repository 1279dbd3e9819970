"""An endpoint's circuit breaker, shared by every webhook sender through Redis
(`sluice:{webhooks}:breaker:<endpoint>`, webhook_breaker.lua): after BREAKER_FAILURES failures in
a row, by whichever senders, the endpoint's deliveries wait (longer at each further failure, at
most BREAKER_MAX_S) instead of each trying on its own schedule; then one delivery, across all
senders, goes first as a probe; a success closes it. Other endpoints are never held up."""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice.broker.plumbing import Scripts
from sluice.broker.webhooks.calls import WebhookBreaker
from sluice.broker.webhooks.outbox import TAG

BREAKER_FAILURES, BREAKER_MAX_S = 5, 600.0
# A breaker untouched this long is forgotten (an endpoint that failed long ago starts closed).
BREAKER_TTL_S = int(4 * BREAKER_MAX_S)


def breaker(endpoint_id: str) -> str:
    return f"{TAG}:breaker:{endpoint_id}"


@dataclass(frozen=True)
class Verdict:
    go: bool
    probe: bool = False  # the one delivery that tests an open circuit
    until: float = 0.0  # with go False: when to try again


class Breakers:
    def __init__(self, redis: Redis, *, base_s: float, probe_s: float) -> None:
        self.redis = redis
        self.base_s = base_s  # the first opening's length (doubled at each further failure)
        self.probe_s = probe_s  # how long the others wait for a probe (its attempt's timeout)
        self.scripts = Scripts(redis)

    async def check(self, endpoint_id: str) -> Verdict:
        waits, value = await self.scripts(self._op(endpoint_id, "check", self.probe_s))
        return Verdict(go=False, until=float(value)) if waits else Verdict(go=True, probe=bool(value))

    async def record(self, endpoint_id: str, delivered: bool, was_probe: bool = False) -> int:
        """Returns the failures in a row now (0 after a success, or a failure not counted)."""
        if delivered:
            return int(await self.scripts(self._op(endpoint_id, "ok", "")))
        return int(await self.scripts(self._op(endpoint_id, "fail", "1" if was_probe else "")))

    def _op(self, endpoint_id: str, op: str, arg4: float | str) -> WebhookBreaker:
        """webhook_breaker.lua's `op` on the endpoint's breaker (`arg4`: probe_s for a check,
        was_probe for a failure; an op reads only the arguments it needs)."""
        return WebhookBreaker(
            key=breaker(endpoint_id), op=op, now=time.time(), threshold=BREAKER_FAILURES, arg4=arg4,
            base_s=self.base_s, max_s=BREAKER_MAX_S, ttl=BREAKER_TTL_S)
