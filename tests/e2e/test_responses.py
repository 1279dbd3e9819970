"""The Responses API with the official SDK on the real engine, over real HTTP: a background
response polled to completion, a stream dropped mid-generation and resumed with
`starting_after`, structured output through `text.format`, and a foreground stream whose
client goes away cancelled like any owned stream."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL, Stack

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]

PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
         "required": ["city"], "additionalProperties": False}


@pytest.fixture
def sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def _final(sdk: openai.AsyncOpenAI, rid: str, timeout_s: float = 120) -> openai.types.responses.Response:
    async with asyncio.timeout(timeout_s):
        while (got := await sdk.responses.retrieve(rid)).status in ("queued", "in_progress"):
            await asyncio.sleep(0.2)
    return got


async def test_background_response_and_a_stream_resumed_after_a_dropped_connection(sdk: openai.AsyncOpenAI) -> None:
    made = await sdk.responses.create(model=MODEL, input="Write a short poem about rivers.", background=True,
                                      max_output_tokens=40, temperature=0, metadata={"run": "e2e"})
    assert made.status in ("queued", "in_progress") and made.background

    seen = []
    stream = await sdk.responses.retrieve(made.id, stream=True)
    async for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) >= 8:
            break  # the connection drops mid-generation
    await stream.close()
    last = seen[-1].sequence_number
    rest = [e async for e in await sdk.responses.retrieve(made.id, stream=True, starting_after=last)]
    assert rest[0].sequence_number == last + 1
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))  # nothing lost, nothing twice
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")

    done = await _final(sdk, made.id)
    assert done.status == "incomplete" and done.output_text == text and done.usage.output_tokens == 40
    assert events[-1].type == "response.incomplete" and done.metadata == {"run": "e2e"}


async def test_structured_output_through_text_format(sdk: openai.AsyncOpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}}
    got = await sdk.responses.create(model=MODEL, input="Name a city as JSON.", text=fmt, max_output_tokens=60,
                                     temperature=0.7, extra_body={"seed": 3})
    assert got.status == "completed", got
    jsonschema.validate(json.loads(got.output_text), PLACE)


async def test_a_foreground_stream_that_disconnects_is_cancelled(sdk: openai.AsyncOpenAI) -> None:
    # ~50 s of tokens unless cancelled (ignore_eos: the model cannot end it early)
    stream = await sdk.responses.create(model=MODEL, input="Count from 1 to 1000, separated by commas.",
                                        stream=True, max_output_tokens=1500, temperature=0,
                                        extra_body={"ignore_eos": True})
    async for event in stream:
        if event.type == "response.output_text.delta":
            rid = event.item_id.replace("msg_", "resp_")
            break
    await stream.close()
    assert (await _final(sdk, rid, timeout_s=60)).status == "cancelled"


async def test_a_background_stream_that_disconnects_runs_on(sdk: openai.AsyncOpenAI) -> None:
    """Watching is not owning: the client that made a background response and streamed it can
    go away; the response still completes (a foreground one is cancelled: above)."""
    stream = await sdk.responses.create(model=MODEL, input="Count from 1 to 100.", stream=True, background=True,
                                        max_output_tokens=24, temperature=0)
    async for event in stream:
        if event.type == "response.output_text.delta":
            rid = event.item_id.replace("msg_", "resp_")
            break
    await stream.close()
    done = await _final(sdk, rid, timeout_s=60)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens > 1
