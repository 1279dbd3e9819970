"""Feed a job's lines onto the bulk lane with a bounded number outstanding, and record each
line's result as its request turns final.

Finals are learnt from the finals listener (broker/replies/notifications.py), as the api's long polls
learn them; the statuses of all outstanding lines are re-read once per re-check interval as
well, so a lost announcement delays a line, never strands it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sluice.broker.intake.admission import Admission, QueueFull
from sluice.broker.intake.cancels import Cancels
from sluice.broker.intake.status_reads import StatusReads
from sluice.broker.jobs.store import JobStore
from sluice.broker.replies.notifications import DoneListener, Inbox
from sluice.broker.status import RequestStatus
from sluice.config.settings import Settings
from sluice.config.tenants import DEFAULT_TENANT
from sluice.protocol.ids import new_request_id
from sluice.protocol.messages import RequestMessage
from sluice.protocol.states import BatchState, State
from sluice.workers.jobs.lines import Line, Record, error_record, output_tokens, result_record

log = logging.getLogger(__name__)

Recorder = Callable[..., Awaitable[None]]  # (index, record, **counts): one line's result, fenced


@dataclass(frozen=True)
class FeedLimits:
    outstanding: int  # a job's rows on the bulk stream at once
    max_queued: int  # the queue bound its submissions count against

    @classmethod
    def of(cls, settings: Settings) -> FeedLimits:
        return cls(outstanding=settings.bulk_outstanding, max_queued=settings.max_queued)


class LineFeed:
    def __init__(self, *, store: JobStore, admission: Admission, cancels: Cancels, statuses: StatusReads,
                 done: DoneListener, job_id: str, batch: dict[str, Any], token: str, record: Recorder,
                 check_lock: Callable[[], None], limits: FeedLimits):
        self.store = store
        self.admission = admission
        self.cancels = cancels
        self.statuses = statuses
        self.done = done
        self.batch = batch
        self.job_id = job_id
        self.token = token
        self.record = record
        self.check_lock = check_lock
        self.limits = limits
        self.outstanding: dict[int, tuple[Line, str]] = {}  # line index -> (line, request id)
        self.cancelling = False

    async def run(self, lines: AsyncIterator[Line]) -> None:
        """Until every line has its record, or (after a cancel) every submitted line has.
        `lines` (the file's valid lines, in order) is read only as far as slots free up."""
        inbox = self.done.inbox()
        try:
            await self._run(inbox, lines)
        finally:
            inbox.close()

    async def _next(self, inbox: Inbox, lines: AsyncIterator[Line], done: set[int],
                    bound: dict[int, str]) -> Line | None:
        """The next line to submit. Resume: a line already recorded is passed over, and a line
        bound to a request that exists is waited for (outstanding), not submitted again."""
        async for x in lines:
            if x.index in done:
                continue
            if x.index in bound:
                inbox.watch(x.model, [bound[x.index]])
                if await self.statuses.status(x.model, bound[x.index]) is not None:
                    self.outstanding[x.index] = (x, bound[x.index])
                    continue
                inbox.forget(bound[x.index])
            return x
        return None

    async def _run(self, inbox: Inbox, lines: AsyncIterator[Line]) -> None:
        done = await self.store.recorded(self.job_id)
        bound = await self.store.request_ids(self.job_id)
        line = await self._next(inbox, lines, done, bound)
        last_full = float("-inf")  # when every outstanding status was last read
        while self.outstanding or (line and not self.cancelling):
            self.check_lock()
            await self._notice_cancel()
            while line and not self.cancelling and len(self.outstanding) < self.limits.outstanding:
                self.check_lock()
                # A line keeps its first id, so a submission lost with its runner is not run twice.
                rid = bound.setdefault(line.index, new_request_id())
                await self.store.bind(self.job_id, self.token, line.index, rid)
                inbox.watch(line.model, [rid])
                try:
                    await self._submit(line, rid)
                except QueueFull:
                    inbox.forget(rid)
                    break  # the bulk lane is full: wait for results to make room
                self.outstanding[line.index] = (line, rid)
                line = await self._next(inbox, lines, done, bound)
            announced = inbox.take()
            # Every re-check interval all of them are read, announced or not: an announcement
            # lost in a reconnect, or a writer that does not announce, costs one interval.
            full = time.monotonic() - last_full >= self.done.recheck_s
            if full:
                last_full = time.monotonic()
            await self._collect(inbox, None if full else announced)
            if not self.outstanding and not (line and not self.cancelling):
                return
            await inbox.wait(max(last_full + self.done.recheck_s - time.monotonic(), 0.0))

    async def _notice_cancel(self) -> None:
        if self.cancelling:
            return
        current = await self.store.get(self.job_id)
        if current and current["status"] == BatchState.CANCELLING:
            self.cancelling = True
            for line, rid in self.outstanding.values():
                await self.cancels.cancel(line.model, rid)

    async def _submit(self, line: Line, rid: str) -> None:
        message = RequestMessage(id=rid, model=line.model, rows=[line.row], sampling=line.sampling,
                                 enqueued_at=time.time(), deadline=float(self.batch["expires_at"]),
                                 lane="bulk", owner=self.batch.get("owner"),
                                 tenant=self.batch.get("tenant") or DEFAULT_TENANT)
        await self.admission.submit(message, max_queued=self.limits.max_queued)

    async def _collect(self, inbox: Inbox, only: set[str] | None) -> None:
        """Record the lines whose request is final: those announced (`only`), or all of them."""
        items = [(i, line, rid) for i, (line, rid) in self.outstanding.items() if only is None or rid in only]
        if not items:
            return
        statuses = await asyncio.gather(*(self.statuses.status(line.model, rid) for _, line, rid in items))
        for (index, line, rid), status in zip(items, statuses):
            record = self._record_for(line, rid, status)
            if record is None:
                continue
            del self.outstanding[index]
            inbox.forget(rid)
            if status is not None and status.result is not None and status.result.status is State.CANCELLED \
                    and self.cancelling:
                continue  # a cancelled batch's output holds what finished
            failed = record["response"] is None
            await self.record(index, record, **({"failed": 1} if failed else
                                                {"completed": 1, "output_tokens": output_tokens(record)}))

    @staticmethod
    def _record_for(line: Line, rid: str, status: RequestStatus | None) -> Record | None:
        """The line's record once its request is final; None while it is not."""
        if status is None:  # its status expired unread: the result is lost with it
            return error_record(line.custom_id, "not_found",
                                "the request's status expired before the job read its result", rid)
        if not status.final or status.result is None:
            return None
        return result_record(line, rid, status.result)
