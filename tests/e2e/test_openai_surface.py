"""The OpenAI SDK's wider surface on the real engine: log probabilities (chat and completions,
with echo, streamed and not), structured outputs (a pydantic model through
`chat.completions.parse`, json_schema, json_object, vLLM's choice and regex), tools (a named
function and "required"), and vLLM's sampling extras (ignore_eos, min_tokens)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL, Stack

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]

PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "Name a famous city and its country."}]
PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                          "population": {"type": "integer"}},
         "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture
def sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def test_chat_logprobs_rank_the_greedy_token_first(sdk: openai.AsyncOpenAI) -> None:
    got = await sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert "".join(t.token for t in content) == got.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)

    stream = await sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=3, stream=True)
    streamed = [t async for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, round(t.logprob, 3)) for t in streamed] == [(t.token, round(t.logprob, 3)) for t in content]


async def test_completion_logprobs_with_the_prompt_echoed(sdk: openai.AsyncOpenAI) -> None:
    got = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = got.choices[0]
    assert choice.text.startswith(PROMPT + " Paris")
    lp = choice.logprobs
    n_prompt = got.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + got.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == PROMPT and lp.tokens[n_prompt] == " Paris"
    assert lp.text_offset[n_prompt] == len(PROMPT)
    assert math.exp(lp.token_logprobs[n_prompt]) > 0.5  # " Paris" is likely, as vLLM reports it (-0.24)


class Place(BaseModel):
    city: str = Field(max_length=20)  # bounded: a sampled string cannot outrun max_tokens
    population: int


async def test_parse_with_a_pydantic_model(sdk: openai.AsyncOpenAI) -> None:
    for seed in (1, 2, 3):
        got = await sdk.chat.completions.parse(model=MODEL, messages=ASK, response_format=Place, max_tokens=80,
                                               temperature=0.7, seed=seed)
        place = got.choices[0].message.parsed
        assert isinstance(place, Place), got.choices[0].message.content


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_json_schema_output_validates(sdk: openai.AsyncOpenAI, route: str) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    for seed in (4, 5):
        if route == "chat":
            got = await sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=rf, max_tokens=80,
                                                    temperature=0.7, seed=seed)
            text = got.choices[0].message.content
        else:
            got = await sdk.completions.create(model=MODEL, prompt="A city as JSON:", max_tokens=80, temperature=0.7,
                                               seed=seed, extra_body={"response_format": rf})
            text = got.choices[0].text
        jsonschema.validate(json.loads(text), PLACE)


async def test_json_object_choice_and_regex(sdk: openai.AsyncOpenAI) -> None:
    got = await sdk.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                            max_tokens=80, temperature=0)
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].message.content), dict | list)
    got = await sdk.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=5,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert got.choices[0].text in ("yes", "no")
    got = await sdk.completions.create(model=MODEL, prompt="A year:", max_tokens=8, temperature=1.0, seed=9,
                                       extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch("(19|20)[0-9]{2}", got.choices[0].text)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}


async def test_tool_calls_for_a_named_function_and_for_required(sdk: openai.AsyncOpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # Greedy: sampled at temperature 1, one CI run's arguments outran max_tokens (no call parsed).
    got = await sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=40,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            temperature=0)
    assert got.choices[0].message.tool_calls, got.choices[0]
    (call,) = got.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    got = await sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=80,
                                            tool_choice="required", temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])

    stream = await sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=80,
                                               tool_choice="required", temperature=0, stream=True)
    deltas = [tc async for chunk in stream for c in chunk.choices for tc in (c.delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
           [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    with pytest.raises(openai.BadRequestError, match="tool_call_parser"):
        await sdk.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=10)


async def test_ignore_eos_and_min_tokens(sdk: openai.AsyncOpenAI) -> None:
    say = [{"role": "user", "content": "Say OK."}]
    plain = await sdk.chat.completions.create(model=MODEL, messages=say, max_tokens=40, temperature=0)
    ends = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and ends < 40  # the model ends the reply (EOS)
    longer = await sdk.chat.completions.create(model=MODEL, messages=say, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 40 and longer.choices[0].finish_reason == "length"
    least = await sdk.chat.completions.create(model=MODEL, messages=say, max_tokens=40, temperature=0,
                                              extra_body={"min_tokens": ends + 3})
    assert least.usage.completion_tokens >= ends + 3


def test_a_deployments_tool_call_parser_reads_the_calls(model_dir: Path) -> None:
    """`tool_choice: "auto"` with `tool_call_parser: hermes`: the worker reads the calls in
    the output with vLLM's parser and the model's tokenizer (the model here is too small to
    call tools on its own, so the outputs are given)."""
    from transformers import AutoTokenizer

    from sluice.workers.engines.tool_calls import parse_tool_calls

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages, tools = [{"role": "user", "content": "Weather in Paris?"}], [WEATHER, TIME]
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    calls, content = parse_tool_calls(tokenizer, "hermes", text, messages, tools)
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert content == "Let me check." and calls[0]["type"] == "function"
    assert parse_tool_calls(tokenizer, "hermes", "It is sunny.", messages, tools) is None
