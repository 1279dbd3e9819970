"""The lines of an OpenAI batch file, as pure code: an input line becomes a typed `Line` or
the error record that stands for it, and a request's final result becomes its output line.

No Redis here: a job's runner (workers/jobs/runner.py) does the I/O, this module the rules, so
that hostile input files are tested without a broker.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sluice.config.model import ModelConfig
from sluice.protocol.ids import batch_line_id, completion_id
from sluice.protocol.messages import FinalResult, SamplingCore, SamplingExtras, SamplingSpec, declared
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest
from sluice.protocol.openai_objects import Shape, chat_object, completion_object
from sluice.protocol.openai_responses import ResponseRequest, response_object
from sluice.protocol.rows import prompt_text, row_problem, sampling_problem, unicode_problem
from sluice.protocol.states import State
from sluice.protocol.tokens import PromptLimits

Record = dict[str, Any]  # one line of an output or error file, as OpenAI writes them


@dataclass(frozen=True)
class Line:
    """A valid input line: what becomes one single-row request on the bulk lane."""

    index: int  # 0-based position in the input file, blank lines counted
    custom_id: str
    model: str
    row: dict[str, Any]
    sampling: SamplingSpec
    shape: Shape
    response: dict[str, Any] | None = None  # a /v1/responses line: what its response object repeats

    @property
    def chat(self) -> bool:
        return "messages" in self.row


@dataclass(frozen=True)
class ParsedFile:
    """An input file's lines: the valid ones, the error records of the others (by index), and
    how many non-blank lines it has (the batch's `total`)."""

    lines: list[Line]
    errors: dict[int, Record]
    total: int


@dataclass(frozen=True)
class Rules:
    """What a line is checked against besides its own shape, as the route it names checks a
    request (protocol/rows.py): the deployed models, by name, the api's prompt limit, and the
    models' context lengths in tokens where their tokenizers can be read (protocol/tokens.py)."""

    models: Mapping[str, ModelConfig]
    max_prompt_chars: int
    prompt_limits: PromptLimits | None = None


def error_record(custom_id: str | None, code: str, message: str, rid: str | None = None) -> Record:
    return {"id": batch_line_id(rid), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}, "request_id": rid}


def parse_file(text: str, endpoint: str, default_max_tokens: int = 256,
               rules: Rules | None = None) -> ParsedFile:
    """Every non-blank line of an input file (whole in memory: for tests and small files; a
    job reads its file a chunk at a time through LineCheck)."""
    check = LineCheck(endpoint, default_max_tokens, rules=rules)
    lines: list[Line] = []
    errors: dict[int, Record] = {}
    for index, raw in enumerate(text.split("\n")):
        if raw.strip():
            parsed = check(index, raw)
            if isinstance(parsed, Line):
                lines.append(parsed)
            else:
                errors[index] = parsed
    return ParsedFile(lines, errors, check.total)


class LineCheck:
    """An input file's non-blank lines, checked in order, one at a time. A custom_id seen on an
    earlier line makes the later line an error: results are matched to inputs by custom_id, so
    two lines sharing one could not be told apart in the output. Only a digest of each custom_id
    is kept, so memory grows by a few dozen bytes a line, whatever the lines hold."""

    def __init__(self, endpoint: str, default_max_tokens: int = 256, max_line_bytes: int | None = None,
                 rules: Rules | None = None):
        self.endpoint = endpoint
        self.default_max_tokens = default_max_tokens
        self.rules = rules
        self.max_line_bytes = max_line_bytes
        self.seen: set[bytes] = set()
        self.total = 0  # non-blank lines checked so far

    def __call__(self, index: int, raw: str | bytes | None) -> Line | Record:
        """Line `index`; `raw` None: a line over max_line_bytes, left unread."""
        self.total += 1
        if raw is None:
            too_long = f"longer than {self.max_line_bytes} bytes (SLUICE_MAX_BATCH_LINE_BYTES)"
            return error_record(None, "line_too_long", f"line {index + 1}: {too_long}")
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        parsed = parse_line(index, text, self.endpoint, self.default_max_tokens, self.rules)
        if not isinstance(parsed, Line):
            return parsed
        digest = hashlib.blake2b(parsed.custom_id.encode(errors="surrogatepass"), digest_size=16).digest()
        if digest in self.seen:
            return error_record(parsed.custom_id, "duplicate_custom_id",
                                f"line {index + 1}: custom_id {parsed.custom_id!r} is used by an earlier "
                                "line")
        self.seen.add(digest)
        return parsed


def parse_line(index: int, text: str, endpoint: str, default_max_tokens: int = 256,
               rules: Rules | None = None) -> Line | Record:
    """A valid line, or the error record that stands for it in the error file. With `rules`, a
    line passes the checks of the route it names, and its max_tokens defaults to its model's."""
    where = f"line {index + 1}"
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:  # deep nesting: not worth a crash
        return error_record(None, "invalid_json", f"{where}: {err}")
    if not isinstance(data, dict):
        return error_record(None, "invalid_request", f"{where}: expected a JSON object")
    unicode = unicode_problem(data)  # JSON may escape a lone surrogate: no Redis write or file takes it
    if unicode:
        return error_record(None, "invalid_request", f"{where}: {unicode}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return error_record(None, "invalid_request", f"{where}: custom_id must be a non-empty string")
    if data.get("method") != "POST" or data.get("url") != endpoint:
        return error_record(custom_id, "invalid_request",
                            f"{where}: method must be POST and url {endpoint} (the batch's endpoint)")
    if endpoint == "/v1/responses":
        return _response_line(index, custom_id, data.get("body"), where, default_max_tokens, rules)
    schema = CompletionRequest if endpoint == "/v1/completions" else ChatCompletionRequest
    try:
        body = schema.model_validate(data.get("body"))
    except ValidationError as err:
        return _invalid_body(custom_id, where, err)
    bad = [message for _, message in body.problems()]
    bad += (["n"] if body.n != 1 else []) + (["stream"] if body.stream else [])
    if isinstance(body, CompletionRequest) and len(body.prompt) != 1:
        bad.append("prompt (one prompt per line)")
    deployed = _deployment_or_refusal(rules, custom_id, where, body.model, bad)
    if isinstance(deployed, dict):
        return deployed
    name, model = deployed
    max_tokens = body.max_tokens or (model.default_max_tokens if model else default_max_tokens)
    if isinstance(body, CompletionRequest):
        row: dict[str, Any] = {"prompt": body.prompt[0], "max_tokens": max_tokens}
    else:
        row = {**body.rows(), "max_tokens": max_tokens}
    fields = body.sampling_fields()
    refused = _refused(rules, model, custom_id, where, row, fields)
    if refused:
        return refused
    # The line's index seeds it when the client gave no seed: a re-run samples the same text.
    seed = body.seed if body.seed is not None else index
    sampling = SamplingSpec(max_tokens=max_tokens, seed=seed, **fields)
    return Line(index, custom_id, name, row, sampling, body.shape())


def _invalid_body(custom_id: str, where: str, err: ValidationError) -> Record:
    first = err.errors()[0]
    return error_record(custom_id, "invalid_request", f"{where}: body: {first['msg']} at "
                                                      f"{'.'.join(map(str, first['loc']))}")


def _unsupported(custom_id: str, where: str, bad: list[str]) -> Record:
    return error_record(custom_id, "invalid_request", f"{where}: not supported in a batch: " + ", ".join(bad))


def _deployment_or_refusal(rules: Rules | None, custom_id: str, where: str, name: str | None,
                           bad: list[str]) -> tuple[str, ModelConfig | None] | Record:
    """The model the line names and its deployment (None without rules), or its error row: the
    problems found, a missing model, an unknown one."""
    if not name:
        bad.append("model (required)")
    if bad or not name:
        return _unsupported(custom_id, where, bad)
    model = _deployment(rules, custom_id, name)
    return model if isinstance(model, dict) else (name, model)


def _deployment(rules: Rules | None, custom_id: str, name: str) -> ModelConfig | Record | None:
    """The deployment a line names (None without rules), or the error record of a model that is
    not deployed."""
    if rules is None:
        return None
    model = rules.models.get(name)
    return model if model is not None else error_record(custom_id, "model_not_found",
                                                        f"model {name!r} is not deployed")


def _refused(rules: Rules | None, model: ModelConfig | None, custom_id: str, where: str,
             row: dict[str, Any], sampling: dict[str, Any]) -> Record | None:
    """The error record of a row its route would refuse (protocol/rows.py), or None."""
    if rules is None or model is None:
        return None
    loaded = rules.prompt_limits.loaded(model) if rules.prompt_limits else None
    vocab = loaded[0].get_vocab_size() if loaded else None
    problem = (row_problem(model, row, max_prompt_chars=rules.max_prompt_chars)
               or sampling_problem(model, sampling, row["max_tokens"], vocab))
    if problem:
        return error_record(custom_id, problem.reason, f"{where}: {problem.message}")
    limits = rules.prompt_limits
    too_long = limits.problem(model, prompt_text(row), row["max_tokens"]) if limits else None
    return error_record(custom_id, "context_length_exceeded", f"{where}: {too_long}") if too_long else None


def _response_line(index: int, custom_id: str, raw: Any, where: str, default_max_tokens: int,
                   rules: Rules | None) -> Line | Record:
    try:
        body = ResponseRequest.model_validate(raw)
    except ValidationError as err:
        return _invalid_body(custom_id, where, err)
    bad = [message for _, message in body.problems()] + [name for name in ("stream", "background")
                                                         if getattr(body, name)]
    deployed = _deployment_or_refusal(rules, custom_id, where, body.model, bad)
    if isinstance(deployed, dict):
        return deployed
    name, model = deployed
    max_tokens = body.max_output_tokens or (model.default_max_tokens if model else default_max_tokens)
    row = {"messages": body.messages(), "max_tokens": max_tokens}
    refused = _refused(rules, model, custom_id, where, row, body.extras())
    if refused:
        return refused
    sampling = SamplingSpec(max_tokens=max_tokens, seed=body.seed if body.seed is not None else index,
                            **declared(body, SamplingCore, SamplingExtras), structured=body.structured())
    return Line(index, custom_id, name, row, sampling, Shape(chat=True), response=body.meta(0))


def result_record(line: Line, rid: str, final: FinalResult) -> Record:
    """The output line (a `done` result) or error line (any other final) of a finished request."""
    if final.status is not State.DONE:
        return error_record(line.custom_id, final.status.value, final.error or final.status.value, rid)
    cid, created = completion_id(rid, chat=line.chat), int(final.timings.finished or 0)
    if line.response is not None:
        meta = {**line.response, "created_at": int(final.timings.enqueued or created)}
        body = response_object(rid, line.model, meta, final.status, final)
    elif line.chat:
        body = chat_object(cid, line.model, created, [final], line.shape, [rid])
    else:
        body = completion_object(cid, line.model, created, [final], line.shape, [line.row["prompt"]])
    return {"id": batch_line_id(rid), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def output_tokens(record: Record) -> int:
    """The completion tokens an output line accounts for (0 for an error line)."""
    response = record.get("response")
    return int(response["body"]["usage"]["completion_tokens"]) if response else 0


def jsonl(records: list[Record]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()
