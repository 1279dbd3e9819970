"""The cap on each api key's open SSE streams (README, "Security")."""

from __future__ import annotations

from collections import Counter
from typing import Any

from starlette.types import Receive, Scope, Send

from sluice.api.errors import ApiError
from sluice.api.sse import EventStream


class StreamSlots:
    """The SSE streams each api key holds open in this api process: at most `per_key`, a 429
    beyond (each open stream holds a connection, a reply reader and its buffers: 10,000 streams
    of one key grew the api 480 MB). Anonymous callers (no keys configured) are bounded by the
    connection cap alone."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self.open: Counter[str] = Counter()

    def reserve(self, owner: str | None) -> Slot:
        """A slot for one more stream of `owner` (a key's digest), or a 429."""
        if owner is not None and self.open[owner] >= self.per_key:
            raise ApiError(429, f"this key has {self.per_key} streams open, the most it may "
                                "(SLUICE_MAX_STREAMS_PER_KEY): close one first", code="too_many_streams",
                           headers={"Retry-After": "1"})
        return Slot(self, owner)


class Slot:
    def __init__(self, slots: StreamSlots, owner: str | None) -> None:
        self.slots, self.owner, self.held = slots, owner, owner is not None
        if self.held:
            slots.open[owner] += 1  # type: ignore[index]

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slots.open[self.owner] -= 1  # type: ignore[index]
            if not self.slots.open[self.owner]:  # type: ignore[index]
                del self.slots.open[self.owner]  # type: ignore[arg-type]


class SlotStream(EventStream):
    """An SSE response that gives its slot back when it ends, however it ends."""

    def __init__(self, slot: Slot, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()
