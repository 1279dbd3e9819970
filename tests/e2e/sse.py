"""A small server-sent-events reader for the tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


@dataclass
class SseEvent:
    event: str
    id: str | None
    data: str

    def json(self) -> dict:
        return json.loads(self.data)


async def sse_events(response: httpx.Response) -> AsyncIterator[SseEvent]:
    event, eid, data = "message", None, []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield SseEvent(event, eid, "\n".join(data))
            event, eid, data = "message", None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "id":
                eid = value
            elif name == "data":
                data.append(value)
