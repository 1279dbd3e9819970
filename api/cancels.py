"""The api's cancels: those a route awaits (`now`), and those started where nothing can await
them (`soon`): an OpenAI stream whose client went away is torn down by the server, and its
`finally` may not await Redis. The app state owns the tasks, so that they are kept referenced
until done (asyncio holds tasks only weakly) and the lifespan lets them reach Redis before its
client closes."""

from __future__ import annotations

import asyncio

from sluice.broker.intake.cancels import Cancels


class BackgroundCancels:
    def __init__(self, cancels: Cancels) -> None:
        self.cancels = cancels
        self._tasks: set[asyncio.Task[object]] = set()

    async def now(self, model: str, rid: str) -> str | None:
        """The resulting state ('cancelled', 'cancelling', or the final one); None if unknown."""
        return await self.cancels.cancel(model, rid)

    def soon(self, model: str, rid: str) -> None:
        task = asyncio.create_task(self.cancels.cancel(model, rid), name=f"cancel-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        """Wait for the cancels under way, up to `timeout_s`; the rest are cancelled (their
        requests run to their end or deadline, as if the api had been killed)."""
        if not self._tasks:
            return
        _, late = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
