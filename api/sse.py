"""Server-sent events as bytes, built directly: the events of one read of a reply stream are
joined into one body chunk, one write per read per connection, where sse_starlette would
build each event through its general encoder (a StringIO and a regex split per field) and
send it on its own.

The fields are written as sse_starlette writes them (`id`, `event`, `data`, CRLF), so a
reader sees the same bytes. `data` must hold no line break: JSON from json.dumps or pydantic
never does (both escape control characters), and the names and ids are ours. Each event is
sent without sse_starlette's per-send cancel scope (EventStream).
"""

from __future__ import annotations

from sse_starlette.sse import EventSourceResponse
from starlette.types import Message, Send

_SEP = "\r\n"


def sse(data: str, event: str | None = None, id: str | None = None) -> str:
    """One event's text (join a read's events, then encode once)."""
    head = ((f"id: {id}{_SEP}" if id is not None else "")
            + (f"event: {event}{_SEP}" if event is not None else ""))
    return f"{head}data: {data}{_SEP}{_SEP}"


def chunk(events: list[str]) -> bytes:
    """A read's events as one body chunk."""
    return "".join(events).encode()


class EventStream(EventSourceResponse):
    """sse_starlette's response, without the cancel scope it opens around every send when no
    send timeout is set (anyio's scope cost more than the send itself: 4 µs an event). With a
    timeout its own send is used."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)
