"""Batch-file lines as pure code: hostile input lines become error records (never a crash),
valid ones typed lines; a final result becomes exactly one output or error line. No Redis."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sluice.api.rows import RowsRefused, checked_rows
from sluice.config.engine import VLLMConfig
from sluice.config.model import ModelConfig
from sluice.protocol.messages import FinalResult, RowOutput, Timings, TokenLogprob, Usage
from sluice.protocol.openai import CompletionRequest
from sluice.protocol.states import State
from sluice.workers.jobs.lines import (
    Line,
    Rules,
    error_record,
    jsonl,
    output_tokens,
    parse_file,
    parse_line,
    result_record,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def line(body: dict[str, Any] | None = None, *, custom_id: Any = "a", url: str = COMPLETIONS,
         method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": "m", "prompt": "hi", **(body or {})}})


def error_of(text: str, endpoint: str = COMPLETIONS) -> dict[str, Any]:
    parsed = parse_line(4, text, endpoint)
    assert not isinstance(parsed, Line), parsed
    assert parsed["response"] is None and parsed["id"].startswith("batch_req_")
    return parsed["error"]


def test_a_valid_completion_line_becomes_a_single_row_request() -> None:
    parsed = parse_line(2, line({"max_tokens": 7, "temperature": 0.5, "stop": "x"}), COMPLETIONS)
    assert isinstance(parsed, Line)
    assert (parsed.index, parsed.custom_id, parsed.model, parsed.chat) == (2, "a", "m", False)
    assert parsed.row == {"prompt": "hi", "max_tokens": 7}
    assert (parsed.sampling.max_tokens, parsed.sampling.temperature, parsed.sampling.stop) == (7, 0.5, ["x"])
    assert parsed.sampling.seed == 2  # no seed given: the line's index, so a re-run samples the same


def test_a_chat_line_keeps_its_messages_and_a_default_max_tokens() -> None:
    text = json.dumps({"custom_id": "c", "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hey"}], "seed": 9}})
    parsed = parse_line(0, text, CHAT, default_max_tokens=33)
    assert isinstance(parsed, Line) and parsed.chat
    assert parsed.row["max_tokens"] == 33 and parsed.row["messages"][0]["content"] == "hey"
    assert parsed.sampling.seed == 9


@pytest.mark.parametrize("text, code, says", [
    ("{not json", "invalid_json", "line 5"),
    ("[1, 2]", "invalid_request", "expected a JSON object"),
    ('"a string"', "invalid_request", "expected a JSON object"),
    ("null", "invalid_request", "expected a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "invalid_json", "line 5"),  # deep nesting: no RecursionError escapes
])
def test_unreadable_lines_are_error_records(text: str, code: str, says: str) -> None:
    err = error_of(text)
    assert err["code"] == code and says in err["message"]


@pytest.mark.parametrize("custom_id", [None, "", 7, ["a"], {"a": 1}])
def test_a_missing_or_non_string_custom_id_is_refused(custom_id: Any) -> None:
    assert "custom_id" in error_of(line(custom_id=custom_id))["message"]


@pytest.mark.parametrize("url, method", [
    (CHAT, "POST"),  # another endpoint than the batch's
    ("/v1/embeddings", "POST"),
    (COMPLETIONS, "GET"),
    (COMPLETIONS, "post"),
])
def test_a_line_for_another_url_or_method_is_refused(url: str, method: str) -> None:
    parsed = parse_line(0, line(url=url, method=method), COMPLETIONS)
    assert not isinstance(parsed, Line)
    assert parsed["custom_id"] == "a"  # the error line still names its input line
    assert "method must be POST and url /v1/completions" in parsed["error"]["message"]


@pytest.mark.parametrize("body, says", [
    ({"max_tokens": 0}, "body:"),
    ({"temperature": 9}, "body:"),
    ({"prompt": None}, "body:"),
    ({"n": 2}, "n"),
    ({"stream": True}, "stream"),
    ({"prompt": ["one", "two"]}, "one prompt per line"),
    ({"model": ""}, "model (required)"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}, "response_format"),
])
def test_a_body_that_a_batch_cannot_run_is_refused(body: dict[str, Any], says: str) -> None:
    err = error_of(line(body))
    assert err["code"] == "invalid_request" and says in err["message"]


def test_a_body_that_is_not_an_object_is_refused() -> None:
    text = json.dumps({"custom_id": "a", "method": "POST", "url": COMPLETIONS, "body": "prompt"})
    assert "body:" in error_of(text)["message"]


def test_a_file_counts_non_blank_lines_and_refuses_a_repeated_custom_id() -> None:
    text = "\n".join([line(custom_id="a"), "", "   ", "{bad", line(custom_id="b"), line(custom_id="a")])
    parsed = parse_file(text, COMPLETIONS)
    assert parsed.total == 4
    assert [x.custom_id for x in parsed.lines] == ["a", "b"]
    assert [x.index for x in parsed.lines] == [0, 4]  # indexes count blank lines: the file's own numbering
    assert sorted(parsed.errors) == [3, 5]
    assert parsed.errors[3]["error"]["code"] == "invalid_json"
    assert parsed.errors[5]["error"]["code"] == "duplicate_custom_id" and parsed.errors[5]["custom_id"] == "a"


def test_an_empty_file_has_no_lines() -> None:
    parsed = parse_file("\n\n  \n", COMPLETIONS)
    assert (parsed.lines, parsed.errors, parsed.total) == ([], {}, 0)


def test_a_huge_line_is_parsed_or_refused_never_a_crash() -> None:
    parsed = parse_line(0, line({"prompt": "x" * 2_000_000}), COMPLETIONS)
    assert isinstance(parsed, Line) and len(parsed.row["prompt"]) == 2_000_000
    assert error_of('{"custom_id": "' + "a" * 1_000_000)["code"] == "invalid_json"


def final(status: State, text: str = "out", error: str | None = None) -> FinalResult:
    return FinalResult(status=status, output=RowOutput(text=text, num_output_tokens=3, finish_reason="length"),
                       usage=Usage(prompt_tokens=2, completion_tokens=3), error=error,
                       timings=Timings(finished=1_700_000_000.5))


def typed(text: str, endpoint: str = COMPLETIONS) -> Line:
    parsed = parse_line(0, text, endpoint)
    assert isinstance(parsed, Line)
    return parsed


def test_a_done_result_is_one_output_line_with_ids_derived_from_its_request() -> None:
    rid = "req-1700000000000-" + "ab" * 16
    record = result_record(typed(line(custom_id="x")), rid, final(State.DONE))
    assert record["id"] == "batch_req_" + rid.removeprefix("req-") and record["custom_id"] == "x"
    assert record["error"] is None and record["response"]["status_code"] == 200
    body = record["response"]["body"]
    assert body["id"] == "cmpl-" + rid.removeprefix("req-") and body["created"] == 1_700_000_000
    assert body["choices"][0]["text"] == "out" and output_tokens(record) == 3
    assert result_record(typed(line(custom_id="x")), rid, final(State.DONE)) == record  # a retry repeats it


def test_a_chat_result_gets_a_chat_completion_id() -> None:
    text = json.dumps({"custom_id": "c", "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hey"}]}})
    record = result_record(typed(text, CHAT), "req-1", final(State.DONE))
    assert record["response"]["body"]["id"] == "chatcmpl-1"
    assert record["response"]["body"]["choices"][0]["message"]["content"] == "out"


@pytest.mark.parametrize("status, error, message", [
    (State.FAILED, "engine crashed", "engine crashed"),
    (State.EXPIRED, None, "expired"),
    (State.CANCELLED, "cancelled by the client", "cancelled by the client"),
])
def test_any_other_final_is_one_error_line(status: State, error: str | None, message: str) -> None:
    record = result_record(typed(line()), "req-9", final(status, error=error))
    assert record["response"] is None and output_tokens(record) == 0
    assert record["error"] == {"code": status.value, "message": message} and record["request_id"] == "req-9"


def test_jsonl_writes_one_record_a_line() -> None:
    records = [error_record("a", "x", "y"), error_record(None, "x", "z")]
    assert [json.loads(x) for x in jsonl(records).decode().splitlines()] == records


def test_a_tool_call_line_constrains_its_request_and_answers_with_tool_calls() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    text = json.dumps({"custom_id": "t", "method": "POST", "url": CHAT, "body": {
        "model": "m", "messages": [{"role": "user", "content": "weather?"}], "logprobs": True,
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}}}})
    parsed = typed(text, CHAT)
    assert parsed.sampling.structured.json_schema == schema and parsed.sampling.logprobs == 0
    assert parsed.row["tools"][0]["function"]["name"] == "weather"
    done = final(State.DONE, text='{"city": "Paris"}')
    done.output.logprobs = [TokenLogprob(token='{"', logprob=-0.1)]
    message = result_record(parsed, "req-t", done)["response"]["body"]["choices"][0]
    assert message["message"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert message["message"]["content"] is None and message["logprobs"]["content"][0]["token"] == '{"'


def test_an_echo_line_answers_with_its_prompt_first() -> None:
    parsed = typed(line({"echo": True, "prompt": "hi"}))
    assert result_record(parsed, "req-e", final(State.DONE))["response"]["body"]["choices"][0]["text"] == "hiout"


RESPONSES = "/v1/responses"


def test_a_responses_line_becomes_a_chat_request_and_answers_with_a_response_object() -> None:
    text = json.dumps({"custom_id": "r", "method": "POST", "url": RESPONSES, "body": {
        "model": "m", "input": "hey", "instructions": "Be brief.", "max_output_tokens": 7,
        "metadata": {"k": "v"}, "text": {"format": {"type": "json_object"}}}})
    parsed = typed(text, RESPONSES)
    assert parsed.row == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hey"}],
                          "max_tokens": 7}
    assert parsed.sampling.structured.json_object and parsed.sampling.seed == 0
    body = result_record(parsed, "req-1700000000000-" + "cd" * 16, final(State.DONE))["response"]["body"]
    assert body["object"] == "response" and body["id"] == "resp_1700000000000-" + "cd" * 16
    assert body["status"] == "incomplete" and body["output"][0]["content"][0]["text"] == "out"  # "length"
    assert body["metadata"] == {"k": "v"} and body["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("body, says", [
    ({"stream": True}, "stream"), ({"background": True}, "background"), ({"tools": [{"type": "x"}]}, "tools"),
    ({"input": []}, "body:"),
])
def test_a_responses_line_a_batch_cannot_run_is_refused(body: dict[str, Any], says: str) -> None:
    text = json.dumps({"custom_id": "r", "method": "POST", "url": RESPONSES,
                       "body": {"model": "m", "input": "hi", **body}})
    err = error_of(text, RESPONSES)
    assert err["code"] == "invalid_request" and says in err["message"]


# A line passes the checks of the route it names (protocol/rows.py, as api/rows.py applies them).
SMALL = ModelConfig(name="m", framework_config=VLLMConfig(max_model_len=100), default_max_tokens=8)
RULES = Rules({"m": SMALL}, max_prompt_chars=10)


def checked(text: str, endpoint: str = COMPLETIONS) -> Line | dict[str, Any]:
    return parse_line(4, text, endpoint, rules=RULES)


def a_line(url: str, body: dict[str, Any], custom_id: Any = "a") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize(("url", "body", "code", "says"), [
    (COMPLETIONS, {"model": "m", "prompt": "x" * 11}, "prompt_too_long", "line 5: prompt: longer than 10 characters"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x" * 6}, {"role": "user", "content": "y" * 5}]},
     "prompt_too_long", "line 5: prompt: longer than 10 characters"),
    (RESPONSES, {"model": "m", "input": "x" * 6, "instructions": "y" * 5}, "prompt_too_long", "longer than 10"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 100}, "max_tokens",
     "line 5: max_tokens: must be below the model's context length (100)"),
    (RESPONSES, {"model": "m", "input": "x", "max_output_tokens": 500}, "max_tokens", "context length (100)"),
    (COMPLETIONS, {"model": "other", "prompt": "x"}, "model_not_found", "model 'other' is not deployed"),
    (COMPLETIONS, {"model": "m", "prompt": "a\ud800"}, "invalid_request", "line 5: not valid Unicode"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}, "invalid_request", "not valid Unicode"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "stop": ["\ud83d"]}, "invalid_request", "not valid Unicode"),
])
def test_a_line_its_route_would_refuse_is_an_error_line(url: str, body: dict[str, Any], code: str,
                                                        says: str) -> None:
    err = checked(a_line(url, body), url)
    assert isinstance(err, dict) and err["response"] is None, err
    assert err["error"]["code"] == code and says in err["error"]["message"], err


def test_a_custom_id_that_is_not_unicode_is_refused_without_repeating_it() -> None:
    err = checked(a_line(COMPLETIONS, {"model": "m", "prompt": "x"}, custom_id="\ud800"))
    assert isinstance(err, dict) and err["custom_id"] is None and "not valid Unicode" in err["error"]["message"]
    json.dumps(err).encode()  # the error file can hold it


def test_a_line_without_max_tokens_gets_its_models_default() -> None:
    parsed = checked(a_line(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x" * 10}]}), CHAT)
    assert isinstance(parsed, Line) and parsed.row["max_tokens"] == 8 and parsed.sampling.max_tokens == 8
    parsed = checked(a_line(RESPONSES, {"model": "m", "input": "x"}), RESPONSES)
    assert isinstance(parsed, Line) and parsed.row["max_tokens"] == 8


@pytest.mark.parametrize("seed", range(30))
def test_a_line_is_refused_exactly_when_the_route_refuses_its_row(seed: int) -> None:
    """Random prompts and budgets against random deployments: a batch line and an api row get
    the same verdict and message."""
    rng = random.Random(seed)
    for _ in range(40):
        model = ModelConfig(name="m", default_max_tokens=rng.randint(1, 300),
                            framework_config=VLLMConfig(max_model_len=rng.choice([None, 50, 200, 4096])))
        limit = rng.randint(1, 40)
        prompt = "p" * rng.randint(1, 50)
        max_tokens = rng.choice([None, rng.randint(1, 5000)])
        body = {"model": "m", "prompt": prompt, **({"max_tokens": max_tokens} if max_tokens else {})}
        parsed = parse_line(0, a_line(COMPLETIONS, body), COMPLETIONS, rules=Rules({"m": model}, limit))
        try:
            row = {"prompt": prompt, "max_tokens": CompletionRequest.model_validate(body).max_tokens}  # as the route
            rows = checked_rows(model, [row], max_prompt_chars=limit)
        except RowsRefused as refused:
            assert isinstance(parsed, dict), (body, refused.message)
            assert parsed["error"] == {"code": refused.reason, "message": f"line 1: {refused.message}"}
        else:
            assert isinstance(parsed, Line), (body, parsed)
            assert parsed.row == rows[0]
