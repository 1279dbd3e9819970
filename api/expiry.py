"""The api's housekeeping sweep: requests past their deadline that no worker started end
`expired` (broker/delivery/expiry.py, lua/expire.lua), whether or not the model has a live
worker. Any api process may sweep; a short lock per model lets one of them do each round."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from sluice.api.deployments import Deployments
from sluice.broker.delivery.expiry import expire_overdue
from sluice.broker.delivery.lanes import lanes_by_slot, shards_in_use
from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing.scripts import Scripts
from sluice.config.settings import Settings

log = logging.getLogger(__name__)


class ExpirySweep:
    def __init__(self, redis: Redis, deployments: Deployments, settings: Settings) -> None:
        self.redis = redis
        self.scripts = Scripts(redis)
        self.deployments = deployments
        self.settings = settings
        self._stopping = asyncio.Event()

    async def sweep(self, *, exclusive: bool = True) -> list[str]:
        """One round over every deployed model's streams; the ids expired. `exclusive`: skip a
        model another api process swept within the interval."""
        s, expired = self.settings, []
        for model in (await self.deployments.all()).values():
            keys = ModelKeys(model.name)
            if exclusive and not await self.redis.set(keys.sweep_lock, "1", nx=True,
                                                      px=max(int(s.expire_interval_s * 900), 1)):
                continue
            for shard, lanes in lanes_by_slot(keys, await shards_in_use(self.redis, keys, model.shards)):
                expired += await expire_overdue(
                    self.redis, self.scripts, shard, lanes, now=time.time(),
                    lease_timeout_s=s.lease_timeout_s, result_ttl_s=model.result_ttl_s or s.result_ttl_s,
                    reply_ttl_s=s.reply_ttl_s)
        return expired

    async def run(self) -> None:
        """Until `stop`; a failed round (Redis away) is logged and tried again."""
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), self.settings.expire_interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.sweep()
            except Exception as err:  # noqa: BLE001 - Redis may be away: the next round tries again
                log.warning("expiry sweep failed (%s); trying again in %g s", err,
                            self.settings.expire_interval_s)

    def stop(self) -> None:
        self._stopping.set()
