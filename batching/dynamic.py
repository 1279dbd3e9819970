"""Dynamic batching: gather requests FIFO; release a batch at a size target or after a delay.

- a batch is released when the waiting rows reach `batch_size_target`, or when the oldest
  waiting request has waited `max_batch_delay_ms`, whichever comes first;
- a batch never holds more than `batch_size_limit` rows; a multi-row request is never
  split: if it does not fit, it waits for the next batch (FIFO is kept, nothing overtakes);
- the next batch is released only when the current one is done; meanwhile only what the
  next batch can take is fetched;
- quarantined requests (a quarantine group: suspects of a crash) are a batch of their own,
  released as soon as they reach the head of the queue; one group waits at a time.
"""

from __future__ import annotations

import asyncio
from collections import deque

from sluice.batching.base import BatchingPolicy, Clock, Handler, MonotonicClock, Source, T
from sluice.config.batching import DynamicBatchingConfig


class DynamicBatcher(BatchingPolicy[T]):
    def __init__(self, config: DynamicBatchingConfig, *, clock: Clock | None = None, poll_s: float = 0.5):
        super().__init__()
        self.config = config
        self.clock = clock or MonotonicClock()
        self.poll_s = poll_s
        self.pending: deque[tuple[float, T]] = deque()  # (arrival time, item), FIFO

    @property
    def capacity(self) -> int:
        """Rows one batch may take (the limit, else the target)."""
        return self.config.batch_size_limit or self.config.batch_size_target

    @property
    def pending_rows(self) -> int:
        return sum(item.rows for _, item in self.pending)

    @property
    def quarantine_pending(self) -> bool:
        return any(item.quarantined for _, item in self.pending)

    def ready(self, now: float) -> bool:
        if not self.pending:
            return False
        if self.pending_rows >= self.config.batch_size_target or self.quarantine_pending:
            return True  # a quarantine group ends the batch before it (or is one): nothing to wait for
        return now - self.pending[0][0] >= self.config.max_batch_delay_ms / 1000

    def take(self) -> list[T]:
        """The longest FIFO prefix that fits the limit (the first item always goes), up to the
        first quarantined item; quarantined items at the head go together, and nothing else with them."""
        limit = self.config.batch_size_limit
        batch: list[T] = []
        rows = 0
        while self.pending:
            item = self.pending[0][1]
            if batch and item.quarantined != batch[0].quarantined:
                break
            if batch and limit is not None and rows + item.rows > limit:
                break
            self.pending.popleft()
            batch.append(item)
            rows += item.rows
        return batch

    async def run(self, source: Source[T], handle: Handler[T], stopping: asyncio.Event) -> None:
        fetching: asyncio.Task | None = None
        stop_wait = asyncio.ensure_future(stopping.wait())
        try:
            while not stopping.is_set():
                now = self.clock.now()
                if not self.in_flight and self.ready(now):
                    self._launch(handle, self.take())
                    continue
                room = self.capacity - self.pending_rows
                if fetching is None and room > 0:
                    quarantine_room = 0 if self.quarantine_pending else room
                    fetching = asyncio.ensure_future(source.fetch(room, self.poll_s, quarantine_room))
                waits: set[asyncio.Future] = {stop_wait, *self._running}
                if fetching is not None:
                    waits.add(fetching)
                timer = None
                if self.pending and not self.in_flight:
                    due = self.pending[0][0] + self.config.max_batch_delay_ms / 1000 - now
                    timer = asyncio.ensure_future(self.clock.sleep(max(due, 0.0)))
                    waits.add(timer)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if timer is not None:
                    timer.cancel()
                if fetching is not None and fetching.done():
                    self._arrived(fetching.result())
                    fetching = None
        finally:
            stop_wait.cancel()
            # What was fetched is held by this worker: run it rather than strand it.
            if fetching is not None:
                self._arrived(await fetching)
            if self.pending:
                self._track(self._run_rest(handle))

    def _arrived(self, items: list[T]) -> None:
        now = self.clock.now()
        self.pending.extend((now, item) for item in items)

    async def _run_rest(self, handle: Handler[T]) -> None:
        """After a stop: the fetched requests, batch after batch."""
        while self.pending:
            await handle(self.take())
