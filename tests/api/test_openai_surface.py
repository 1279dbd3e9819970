"""The OpenAI routes' wider surface in-process, with a null-engine worker: vLLM's sampling
extras, structured outputs and tools reach the queued entry as the engine needs them; what
cannot be served is a 400 naming the field; log probabilities and echoed prompts come back in
OpenAI's shapes, streamed and not. (The real engine's side: tests/e2e/test_openai.py.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from redis.asyncio import Redis

from sluice.bench.sse import sse_events
from sluice.broker.replies.writer import _coalesce, delivered
from sluice.protocol.messages import DeltaEvent, FinalResult, RequestMessage, RowOutput, TokenLogprob
from sluice.protocol.openai_objects import Shape, chat_object
from sluice.protocol.openai_tools import AUTO
from sluice.protocol.states import State
from sluice.workers.worker import Worker
from tests.api.conftest import StartApi, http_client
from tests.broker.helpers import KEYS, MODEL
from tests.fakes import eventually

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "hello"}]


async def _entry(api: httpx.AsyncClient, redis: Redis, path: str, body: dict) -> RequestMessage:
    """The request entry the body is queued as (no worker runs: it stays on the stream)."""
    call = asyncio.create_task(api.post(path, json={"model": MODEL, **body}))  # waits for a final: none comes
    try:
        await eventually(lambda: _queued(redis), what="the request to be queued")
    finally:
        call.cancel()
    entries = await redis.xrange(KEYS.requests)
    return RequestMessage.from_fields(entries[-1][1])


async def _queued(redis: Redis) -> bool:
    return await redis.xlen(KEYS.requests) > 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "p", "logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "p", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "p", "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"prompt": "p", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    # refused by the decoding backend's compiler, before anything is queued
    ("/v1/completions", {"prompt": "p", "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "p", "structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "p", "structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "p", "structured_outputs": {"yaml": "x"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "p", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "p", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "p", "guided_regex": "a+", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS}, "tool_choice"),  # "auto": no parser
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    # a function's parameters the decoding backend cannot compile, named or among "required"
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "bad", "parameters": {"type": "wat"}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": {"type": "function", "function": {"name": "bad"}},
                              "tools": [{"type": "function", "function": {"name": "bad",
                                                                          "parameters": {"$ref": "#/nope"}}}]},
     "tools"),
])
async def test_what_cannot_be_served_is_a_400_naming_the_field(api: httpx.AsyncClient, redis: Redis, path: str,
                                                               body: dict, param: str) -> None:
    r = await api.post(path, json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]
    assert await redis.xlen(KEYS.requests) == 0  # nothing queued


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_constraint_is_checked_off_the_loop_and_a_plain_call_without_a_thread(
        api: httpx.AsyncClient, redis: Redis, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    hops = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda f, *a, **kw: hops.append(f.__name__) or to_thread(f, *a, **kw))
    bodies = [{}, {"guided_regex": "[0-9]+"}, {"response_format": {"type": "json_object"}}]
    if path == "/v1/chat/completions":
        bodies.append({"tools": TOOLS, "tool_choice": "required"})
    for extra in bodies:
        prompt = {"prompt": "p"} if path == "/v1/completions" else {"messages": CHAT}
        await _entry(api, redis, path, {"max_tokens": 4, **prompt, **extra})
        await redis.xtrim(KEYS.requests, maxlen=0)
    assert hops.count("problems") == len(bodies) - 1, hops


async def test_auto_tool_choice_names_the_setting_it_needs(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "tools": TOOLS})
    assert "tool_call_parser" in r.json()["error"]["message"]


async def test_vllm_sampling_extras_reach_the_entry(api: httpx.AsyncClient, redis: Redis) -> None:
    entry = await _entry(api, redis, "/v1/completions", {
        "prompt": "p", "max_tokens": 4, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
        "ignore_eos": True, "stop_token_ids": [7, 8], "logprobs": 3, "echo": True})
    s = entry.sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens) == (5, 0.1, 1.2, 2)
    assert s.ignore_eos and s.stop_token_ids == [7, 8] and s.logprobs == 3 and s.prompt_logprobs == 3
    assert s.structured is None


@pytest.mark.parametrize(("body", "want"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     {"json_schema": SCHEMA}),
])
async def test_structured_output_reaches_the_entry(api: httpx.AsyncClient, redis: Redis, body: dict,
                                                   want: dict) -> None:
    entry = await _entry(api, redis, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **body})
    got = entry.sampling.structured.model_dump(exclude_defaults=True)
    assert got == want
    if "tools" in body:
        assert [t["function"]["name"] for t in entry.rows[0]["tools"]] == ["get_weather", "get_time"]


async def test_required_tool_choice_constrains_to_a_list_of_calls(api: httpx.AsyncClient, redis: Redis) -> None:
    entry = await _entry(api, redis, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 4, "tools": TOOLS, "tool_choice": "required"})
    schema = entry.sampling.structured.json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == SCHEMA


async def test_completion_logprobs_and_echo(api: httpx.AsyncClient, null_worker: Worker) -> None:
    r = await api.post("/v1/completions", json={"model": MODEL, "prompt": "say hi", "max_tokens": 3,
                                                "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == "say hi t0 t1 t2"
    lp = choice["logprobs"]
    # the prompt's tokens (the null engine's are its words), then the completion's
    assert lp["tokens"] == ["say", " hi", " t0", " t1", " t2"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][2:] == [-0.5] * 3
    assert [len(t) for t in lp["top_logprobs"][2:]] == [2, 2, 2]
    assert lp["text_offset"] == [0, 3, 6, 9, 12]

    plain = (await api.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 2})).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == " t0 t1"


async def test_streamed_completion_logprobs_and_echo(api: httpx.AsyncClient, null_worker: Worker) -> None:
    async with api.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "say hi", "max_tokens": 3,
                                                           "logprobs": 1, "echo": True, "stream": True}) as r:
        chunks = [json.loads(e.data) async for e in sse_events(r) if e.data != "[DONE]"]
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == "say hi t0 t1 t2"
    assert choices[0]["text"] == "say hi"  # the prompt first
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == ["say", " hi", " t0", " t1", " t2"] and offsets == [0, 3, 6, 9, 12]
    assert choices[-1]["finish_reason"] == "length"


async def test_chat_logprobs_streamed_and_not(api: httpx.AsyncClient, null_worker: Worker) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    r = await api.post("/v1/chat/completions", json=body)
    (choice,) = r.json()["choices"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [" t0", " t1", " t2"]
    assert all(c["logprob"] == -0.5 and c["bytes"] == list(c["token"].encode()) for c in content)
    assert [[a["token"] for a in c["top_logprobs"]] for c in content][0] == [" t0", " alt1"]

    async with api.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e.data) async for e in sse_events(r) if e.data != "[DONE]"]
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["content"]]
    assert streamed == content
    no = (await api.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None})).json()
    assert no["choices"][0]["logprobs"] is None


async def test_a_retry_keeps_the_logprobs_its_stream_delivered(redis: Redis) -> None:
    """The final of a resumed request has a log probability for every token: those of the
    attempt before come from the reply stream, beside its tokens."""
    rid = "req-logprobs"

    def ev(i: int, n: int, **kw: object) -> DeltaEvent:
        return DeltaEvent(i=i, text="".join(f" t{k}" for k in range(i, i + n)), token_ids=list(range(i, i + n)),
                          logprobs=[TokenLogprob(token=f" t{k}", logprob=-k) for k in range(i, i + n)], **kw)

    first = [ev(0, 1, prompt_logprobs=[TokenLogprob(token="p", logprob=None)]), ev(1, 2)]
    for e in first:
        await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": e.model_dump_json(exclude_none=True)})
    row = (await delivered(redis, MODEL, rid))[0]
    assert row.token_ids == [0, 1, 2] and [t.logprob for t in row.logprobs] == [0, -1, -2]
    assert row.prompt_logprobs == [TokenLogprob(token="p", logprob=None)]
    # a lagging writer joins deltas: their log probabilities are joined with them
    owner = SimpleNamespace(entry_id="1-0", attempt=1)
    joined = _coalesce([(owner, e) for e in first])  # type: ignore[misc]
    assert len(joined) == 1 and [t.token for t in joined[0][1].logprobs] == [" t0", " t1", " t2"]


async def test_priority_picks_the_lane_lower_first(api: httpx.AsyncClient, redis: Redis) -> None:
    """vLLM's `priority`, lower first: above 0 a request waits in the bulk lane (its own share
    of the queue bound, and never a worker's reserved slot); 0 and below are interactive."""
    urgent = await _entry(api, redis, "/v1/completions", {"prompt": "p", "max_tokens": 2, "priority": -5})
    assert (urgent.lane, urgent.priority) == ("interactive", -5)
    r = await api.post("/v1/requests", json={"prompt": "later", "max_tokens": 2, "priority": 3})
    assert r.status_code == 202, r.text
    ((_, fields),) = await redis.xrange(KEYS.bulk)
    low = RequestMessage.from_fields(fields)
    assert (low.id, low.lane, low.priority) == (r.json()["id"], "bulk", 3)


PARSER_MODELS = (f"models:\n  - name: {MODEL}\n    tool_call_parser: hermes\n"
                 "    continuous_batching_config: {max_concurrent_batch_size: 4}\n")


async def test_auto_tool_choice_with_a_deployments_parser(start_api: StartApi, redis: Redis) -> None:
    """With `tool_call_parser` set, "auto" generates freely with the tools in the chat
    template, and the worker's parser reads the calls (tests/e2e: the parser itself)."""
    async with start_api(PARSER_MODELS) as app, http_client(app) as api:
        entry = await _entry(api, redis, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "tools": TOOLS})
    row = entry.rows[0]
    assert row["tool_parser"] == "hermes" and [t["function"]["name"] for t in row["tools"]] == ["get_weather",
                                                                                              "get_time"]
    assert entry.sampling.structured is None


def test_parsed_tool_calls_become_the_message() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    found = FinalResult(status=State.DONE, output=RowOutput(text="<tool_call>...", num_output_tokens=9,
                                                            finish_reason="stop", tool_calls=calls,
                                                            tool_content="Let me check."))
    plain = FinalResult(status=State.DONE, output=RowOutput(text="Hello", num_output_tokens=1, finish_reason="stop"))
    shape = Shape(chat=True, tool=AUTO)
    got = chat_object("chatcmpl-1", MODEL, 0, [found, plain], shape, ["req-1", "req-2"])["choices"]
    assert got[0]["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": calls}
    assert got[0]["finish_reason"] == "tool_calls"
    assert got[1]["message"] == {"role": "assistant", "content": "Hello"} and got[1]["finish_reason"] == "stop"
