"""Finding a request again: which model holds it, and its status once final."""

from __future__ import annotations

import asyncio
import time

from sluice.api.deployments import Deployments
from sluice.api.errors import ApiError
from sluice.broker.intake.status_reads import StatusReads
from sluice.broker.replies.notifications import DoneListener
from sluice.broker.status import RequestStatus
from sluice.protocol.ids import request_created_at
from sluice.protocol.messages import FinalResult


class RequestLookup:
    def __init__(self, statuses: StatusReads, done: DoneListener, deployments: Deployments,
                 default_result_ttl_s: int) -> None:
        self.statuses = statuses
        self.done = done
        self.deployments = deployments
        self.default_result_ttl_s = default_result_ttl_s

    async def wait_final(self, model: str, rid: str, wait_s: float, *, fresh: bool = False,
                         known: RequestStatus | None = None) -> RequestStatus:
        """The status once the request is final, or as it is after `wait_s`. `fresh`: the caller
        has just admitted it, so it is not final unless announced: while the listener hears its
        channel, the first status read waits for the announcement (or the re-check interval).
        `known`: the status the caller has just read, taken for the first read when nothing is
        waited for (`wait_s` 0: a plain poll reads the hash once)."""
        deadline = time.monotonic() + wait_s
        with self.done.watch(model, rid, recent=fresh) as done:
            if fresh and self.done.live(model, rid):
                await self.done.wait(done, wait_s)
            while True:
                if done.done() and done.result() and not self.statuses.limits.wait_replicas:
                    return announced(rid, model, done.result())  # the final as written, no read
                held = False
                status = (known if known is not None and wait_s <= 0
                          else await self.statuses.status(model, rid))
                # a final is shown once a failover keeps it
                if status and status.final and self.statuses.limits.wait_replicas:
                    status, held = await self.statuses.status_copied(model, rid)
                if not status:
                    raise ApiError(404, f"request {rid!r} not found", code="not_found")
                remaining = deadline - time.monotonic()
                if status.final or remaining <= 0:
                    return status
                if done.done() and not held:  # announced, yet not final here: never spin on it
                    await asyncio.sleep(min(remaining, self.done.recheck_s))
                elif not held:  # (a held final is asked again at once: its WAIT took a while)
                    await self.done.wait(done, remaining)

    async def status_of(self, rid: str) -> RequestStatus:
        """The status of a request that Redis still holds (its `model` says whose); 410 for one
        whose result expired (its id is older than the retention, which is as much as can be
        known once its keys are gone), 404 for an id that is young, of another form, or unknown."""
        deployed = await self.deployments.all()
        status = await self.statuses.find_status(rid, list(deployed))
        if status is not None:
            return status
        created = request_created_at(rid)
        retention = min((m.result_ttl_s or self.default_result_ttl_s for m in deployed.values()),
                        default=self.default_result_ttl_s)
        if created is not None and time.time() - created > retention:
            raise ApiError(410, f"request {rid!r} expired: a result is kept for {retention} s after the "
                                f"request finishes, and this one is gone", code="expired")
        raise ApiError(404, f"request {rid!r} not found", code="not_found")


def announced(rid: str, model: str, final: str) -> RequestStatus:
    """The status of a request whose announcement carried its final (what its status hash holds)."""
    result = FinalResult.model_validate_json(final)
    return RequestStatus(id=rid, model=model, state=result.status, result=result)
