"""An endpoint's circuit breaker, shared by every webhook sender through Redis
(`sluice:{webhooks}:breaker:<endpoint>`, webhook_breaker.lua): after BREAKER_FAILURES failures in
a row, by whichever senders, the endpoint's deliveries wait (longer at each further failure, at
most BREAKER_MAX_S) instead of each trying on its own schedule; then one delivery, across all
senders, goes first as a probe; a success closes it. Other endpoints are never held up."""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from sluice.broker.plumbing.scripts import _read  # TRANSITIONAL
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
        self._script: AsyncScript = redis.register_script(_read("webhook_breaker"))

    async def check(self, endpoint_id: str) -> Verdict:
        waits, value = await self._script(keys=[breaker(endpoint_id)],
                                          args=["check", time.time(), BREAKER_FAILURES, self.probe_s])
        return Verdict(go=False, until=float(value)) if waits else Verdict(go=True, probe=bool(value))

    async def record(self, endpoint_id: str, delivered: bool, was_probe: bool = False) -> int:
        """Returns the failures in a row now (0 after a success, or a failure not counted)."""
        if delivered:
            return int(await self._script(keys=[breaker(endpoint_id)], args=["ok", time.time(), BREAKER_FAILURES]))
        return int(await self._script(keys=[breaker(endpoint_id)],
                                      args=["fail", time.time(), BREAKER_FAILURES, "1" if was_probe else "",
                                            self.base_s, BREAKER_MAX_S, BREAKER_TTL_S]))
