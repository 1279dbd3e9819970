"""The one server-sent-events reader of the benchmarks and the tests (the WHATWG EventSource
parsing rules): lines in, events out, from a sync or an async source of lines.

A line may come with or without its terminator (`\\n`, `\\r\\n` or `\\r`), as str or as UTF-8
bytes, so httpx's `iter_lines()` / `aiter_lines()`, aiohttp's `response.content` and an asyncio
`StreamReader` all feed it as they are. An event is dispatched at the blank line that ends it:
one still open when the source ends (a dropped connection) is not, as EventSource drops it.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

_EOL = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SseEvent:
    event: str  # "message" when the event named none
    id: str | None  # this event's own id field; SseParser.last_id keeps the stream's last one
    data: str  # its data lines joined by "\n"

    def json(self) -> Any:
        return json.loads(self.data)


class SseParser:
    """Feed it lines; `feed` returns the events its blank lines complete. Comments (`: text`) are
    kept in `comments`, the last `retry:` (milliseconds) in `retry_ms`."""

    def __init__(self) -> None:
        self.last_id: str | None = None
        self.retry_ms: int | None = None
        self.comments: list[str] = []
        self._first = True
        self._reset()

    def _reset(self) -> None:
        self._event: str = "message"
        self._id: str | None = None
        self._data: list[str] = []

    def feed(self, line: str | bytes) -> list[SseEvent]:
        """One line. (A line that still holds a line break, as from a source that splits on
        "\\n" alone reading a stream that uses "\\r", is taken as the lines it holds.)"""
        text = line.decode() if isinstance(line, bytes) else line
        if self._first:
            text, self._first = text.removeprefix("\ufeff"), False
        if text.endswith("\n"):  # the line's own terminator
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
        elif text.endswith("\r"):
            text = text[:-1]
        pieces = _EOL.split(text) if "\n" in text or "\r" in text else (text,)
        return [event for piece in pieces if (event := self._line(piece)) is not None]

    def _line(self, line: str) -> SseEvent | None:
        if line == "":
            event = SseEvent(self._event, self._id, "\n".join(self._data)) if self._data else None
            self._reset()
            return event
        if line.startswith(":"):
            self.comments.append(line[1:].removeprefix(" "))
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value or "message"
        elif name == "id" and "\0" not in value:
            self._id = self.last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None  # any other field is ignored


def events(lines: Iterable[str | bytes], parser: SseParser | None = None) -> Iterator[SseEvent]:
    """The events of a sync source of lines (httpx's `response.iter_lines()`)."""
    parser = parser or SseParser()
    for line in lines:
        yield from parser.feed(line)


async def aevents(lines: AsyncIterable[str | bytes],
                  parser: SseParser | None = None) -> AsyncIterator[SseEvent]:
    """The events of an async source of lines (aiohttp's `response.content`, a StreamReader)."""
    parser = parser or SseParser()
    async for line in lines:
        for event in parser.feed(line):
            yield event


def sse_events(response: httpx.Response, parser: SseParser | None = None) -> AsyncIterator[SseEvent]:
    """The events of an httpx response being streamed (`client.stream(...)` or a plain request)."""
    return aevents(response.aiter_lines(), parser)


def parse(text: str | bytes, parser: SseParser | None = None) -> list[SseEvent]:
    """The events of a whole body (a final line with no terminator is taken as a line)."""
    lines = _EOL.split(text.decode() if isinstance(text, bytes) else text)
    if lines[-1] == "":
        lines.pop()  # what follows the last terminator
    return list(events(lines, parser))
