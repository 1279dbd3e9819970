"""OpenAI's response objects and stream chunks from Sluice's finals and deltas: completions
and chat completions, with log probabilities, echoed prompts and tool calls in OpenAI's shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.protocol.messages import FinalResult, RowOutput, TokenLogprob
from sluice.protocol.openai_tools import AUTO, REQUIRED, tool_calls

LOGPROB_FLOOR = -9999.0  # as vLLM: -inf is not JSON


@dataclass(frozen=True)
class Shape:
    """What the client asked to see besides the text."""

    chat: bool
    logprobs: int | None = None  # alternatives per token (chat: top_logprobs); None: no logprobs
    echo: bool = False  # completions: the prompt before the completion
    tool: str | None = None  # chat: REQUIRED, AUTO, or the function that must be called


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, LOGPROB_FLOOR)


def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(a, b) for a, b in t.top]}
                        for t in tokens], "refusal": None}


def completion_logprobs(tokens: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy shape: parallel lists, `text_offset` counting characters from `offset`."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [_lp(t.logprob) for t in tokens],
            "top_logprobs": [None if t.logprob is None else {a: _lp(b) for a, b in t.top} for t in tokens],
            "text_offset": offsets}


def usage(finals: list[FinalResult]) -> dict[str, int]:
    prompt = sum(f.usage.prompt_tokens for f in finals if f.usage)
    completion = sum(f.usage.completion_tokens for f in finals if f.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _reason(f: FinalResult) -> str:
    return (f.output.finish_reason if f.output else None) or "stop"


def completion_object(cid: str, model: str, created: int, finals: list[FinalResult], shape: Shape,
                      prompts: list[str] | None = None) -> dict[str, Any]:
    choices = []
    for i, f in enumerate(finals):
        out = f.output
        prompt = prompts[i] if shape.echo and prompts else ""
        logprobs = None
        if shape.logprobs is not None and out is not None:
            logprobs = completion_logprobs(out.logprobs or [], len(prompt))
            if shape.echo:  # the prompt's tokens first; the completion's offsets follow the prompt's text
                echoed = completion_logprobs(out.prompt_logprobs or [])
                logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
        choices.append({"index": i, "text": prompt + (out.text if out else ""), "logprobs": logprobs,
                        "finish_reason": _reason(f)})
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals)}


def chat_message(shape: Shape, output: RowOutput | None, reason: str, rid: str) -> tuple[dict[str, Any], str]:
    """The assistant message and its finish reason: tool calls when they were asked for and
    the output holds complete ones, else the text."""
    text = output.text if output else ""
    if shape.tool == AUTO:  # the deployment's tool-call parser read them (on the worker)
        if output is None or not output.tool_calls:
            return {"role": "assistant", "content": text}, reason
        message = {"role": "assistant", "content": output.tool_content, "tool_calls": output.tool_calls}
        return message, "tool_calls"
    calls = tool_calls(shape.tool, text, rid) if shape.tool else None
    if calls is None:
        return {"role": "assistant", "content": text}, reason
    # As vLLM: "tool_calls" for `required`; a named function's call ends with "stop".
    called = "tool_calls" if shape.tool == REQUIRED else reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, called


def chat_object(cid: str, model: str, created: int, finals: list[FinalResult], shape: Shape,
                rids: list[str]) -> dict[str, Any]:
    choices = []
    for i, (f, rid) in enumerate(zip(finals, rids)):
        message, reason = chat_message(shape, f.output, _reason(f), rid)
        logprobs = chat_logprobs(f.output.logprobs or []) if shape.logprobs is not None and f.output else None
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals)}
