"""A bulk job's lock, held by one runner at a time and kept fresh from a task of its own.

The lock is the job's fence: every write a runner makes is checked against it in Redis
(broker/jobs/store.py); this keeper only lets the runner stop early once it is lost.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from redis.exceptions import RedisError

from sluice.broker.jobs.store import JobStore, LockLost
from sluice.protocol.states import FINAL_BATCH_STATES

log = logging.getLogger(__name__)

# The longest wait between two refreshes (a third of the TTL when that is shorter): a live
# runner shows itself to a second run within about this (JobStore.runner_alive), whatever the
# TTL, and a long TTL only makes the lock outlast longer stalls.
REFRESH_S = 1.0


class JobLock:
    def __init__(self, store: JobStore, job_id: str, ttl_s: float):
        self.store = store
        self.job_id = job_id
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(16)  # fences this run's writes: a secret, not an id anyone reads
        self._expires = 0.0  # monotonic time by which the lock lapses unless refreshed
        self._lost = False
        self._finished = False  # the run is over: the keeper stops
        self._keeper: asyncio.Task[None] | None = None

    async def acquire(self) -> bool:
        """The lock, at once or once a gone runner's lock has lapsed; False when the job is
        final or a live runner holds it. Starts keeping it fresh."""
        while True:
            asked = time.monotonic()
            if await self.store.lock(self.job_id, self.token, self.ttl_s):
                self._expires = asked + self.ttl_s
                self._keeper = asyncio.create_task(self._keep(), name=f"lock-{self.job_id}")
                return True
            batch = await self.store.get(self.job_id)
            if batch is None or batch["status"] in FINAL_BATCH_STATES:
                return False
            if await self.store.runner_alive(self.job_id):
                log.info("batch %s: a live runner has it", self.job_id)
                return False

    def check(self) -> None:
        """Raise LockLost once the keeper has seen the lock go."""
        if self._lost:
            raise LockLost(self.job_id)

    async def release(self) -> None:
        self._finished = True
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.wait([self._keeper], timeout=5)
        await self.store.unlock(self.job_id, self.token)

    async def _keep(self) -> None:
        """Refresh the lock; mark it lost when another runner holds it, it has lapsed, or Redis
        could not be reached to refresh it before it would lapse."""
        while not self._finished:  # a flag as well: redis-py can swallow a cancel (see Worker.run)
            await asyncio.sleep(min(self.ttl_s / 3, REFRESH_S))
            if self._finished:
                return
            asked = time.monotonic()
            try:
                if not await self.store.refresh_lock(self.job_id, self.token, self.ttl_s):
                    break
                self._expires = asked + self.ttl_s
            except RedisError as err:
                log.warning("batch %s: could not refresh its lock: %s", self.job_id, err)
                if time.monotonic() >= self._expires:
                    break
        self._lost = True
