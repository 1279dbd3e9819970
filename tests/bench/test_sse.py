"""The one server-sent-events reader (sluice.bench.sse): the EventSource parsing rules, from
every kind of line source the tests and the benchmarks read."""

from __future__ import annotations

import httpx
import pytest

from sluice.bench.sse import SseEvent, SseParser, aevents, events, parse, sse_events

STREAM = (": hello\n"
          "retry: 1500\n"
          "\n"
          "id: 1-0\n"
          "event: delta\n"
          'data: {"text": " a"}\n'
          "\n"
          "data: one\n"
          "data:two\n"
          "data: \n"
          "\n"
          "id: 2-0\n"
          "event: done\n"
          'data: {"status": "done"}\n'
          "\n")
WANT = [SseEvent("delta", "1-0", '{"text": " a"}'), SseEvent("message", None, "one\ntwo\n"),
        SseEvent("done", "2-0", '{"status": "done"}')]


def test_events_ids_multi_line_data_comments_and_retry() -> None:
    parser = SseParser()
    assert parse(STREAM, parser) == WANT
    assert WANT[0].json() == {"text": " a"}
    assert parser.comments == ["hello"] and parser.retry_ms == 1500 and parser.last_id == "2-0"


@pytest.mark.parametrize("eol", ["\r\n", "\r"])
def test_crlf_and_cr_line_ends_read_as_lf(eol: str) -> None:
    assert parse(STREAM.replace("\n", eol)) == WANT
    assert parse(STREAM.replace("\n", eol).encode()) == WANT


def test_a_line_split_only_on_lf_keeps_no_cr_and_splits_at_a_lone_cr() -> None:
    # What aiohttp's response.content and a StreamReader yield: raw lines, their terminators kept.
    raw = [line + "\n" for line in STREAM.replace("\n", "\r\n").split("\n")[:-1]]
    assert list(events(raw)) == WANT
    assert SseParser().feed(b"event: x\rdata: y\r\rdata: z\r\r") == [SseEvent("x", None, "y"),
                                                                  SseEvent("message", None, "z")]


def test_data_split_across_lines_and_chunks_is_one_event() -> None:
    # The lines arrive from httpx's decoder however the body was chunked on the wire.
    body = b"event: delta\ndata: {\"text\":\ndata:  \"a\"}\n\n"
    chunks = [body[i:i + 3] for i in range(0, len(body), 3)]
    response = httpx.Response(200, stream=httpx.ByteStream(b"".join(chunks)))
    got = list(events(response.iter_lines()))
    assert got == [SseEvent("delta", None, '{"text":\n "a"}')] and got[0].json() == {"text": "a"}


def test_a_trailing_event_without_its_blank_line_is_not_dispatched() -> None:
    # A stream that drops mid-event: EventSource drops the incomplete event, and so does this.
    assert parse("data: a\n\ndata: b") == [SseEvent("message", None, "a")]
    assert parse("data: a\n\nevent: done\ndata: b\n") == [SseEvent("message", None, "a")]


def test_what_dispatches_nothing() -> None:
    parser = SseParser()
    # a comment only, an event name and an id with no data, unknown fields, a bad retry
    assert parse(":keepalive\n\nevent: x\nid: 9\n\nfoo: bar\nretry: 1x\n\n", parser) == []
    assert parser.comments == ["keepalive"] and parser.retry_ms is None and parser.last_id == "9"
    # the event name and id of an undispatched block do not leak into the next event
    assert parse("event: x\nid: 1\n\ndata: y\n\n") == [SseEvent("message", None, "y")]


def test_field_edge_cases() -> None:
    assert parse("\ufeffdata: a\n\n") == [SseEvent("message", None, "a")]  # a byte-order mark first
    assert parse("data\n\n") == [SseEvent("message", None, "")]  # a field with no colon
    assert parse("data:  two spaces\n\n")[0].data == " two spaces"  # only one space is dropped
    assert parse("data: a: b\n\n")[0].data == "a: b"  # only the first colon splits
    assert parse("id: a\0b\ndata: x\n\n")[0].id is None  # an id holding NUL is ignored
    assert parse("event:\ndata: x\n\n")[0].event == "message"


async def test_async_sources_and_an_httpx_response() -> None:
    async def lines():
        for line in STREAM.encode().split(b"\n")[:-1]:
            yield line + b"\n"

    assert [e async for e in aevents(lines())] == WANT
    response = httpx.Response(200, text=STREAM.replace("\n", "\r\n"))
    assert [e async for e in sse_events(response)] == WANT
