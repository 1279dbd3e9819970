"""vLLM's `/tokenize` and `/detokenize`, answered by the api itself with the model's own
tokenizer (the one that checks prompt lengths), so nothing is queued for them. Chat messages
are rendered with the model's chat template first, as the worker renders them."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.api.errors import ApiError
from sluice.api.schemas import require_unicode
from sluice.api.state import ApiState, state
from sluice.config.model import ModelConfig
from sluice.protocol.openai import ChatMessage
from sluice.protocol.tokens import Loaded

router = APIRouter(tags=["vllm"])


def max_body_bytes(max_prompt_chars: int) -> int:
    """/tokenize's body cap (api/limits.py refuses a body over it by its Content-Length, or as
    a chunked one passes it, before it is read and parsed): the longest body a prompt of
    max_prompt_chars can be, at 12 bytes a character (a JSON-escaped surrogate pair), plus room
    for the other fields. A prompt over the limit is refused with 413 either way."""
    return 12 * max_prompt_chars + 64 * 1024


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=128)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = Field(default=None, max_length=128)
    tokens: list[int] = Field(max_length=1_000_000)


async def _tokenizer(s: ApiState, model: ModelConfig) -> Loaded:
    loaded = await s.intake.prompt_limits.load(model)  # read off the event loop if not yet
    if loaded is None:
        raise ApiError(501, f"model {model.name!r}: its tokenizer is not readable by the api (its files are "
                            f"not on this host), so it cannot tokenize here", code="not_implemented")
    return loaded


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: ApiState = Depends(state)) -> dict:
    model = await s.deployments.get(body.model)
    # The prompt limit of the routes that queue (max_prompt_chars), checked before any tokenizing
    limit, param = s.settings.max_prompt_chars, "prompt" if body.prompt is not None else "messages"
    if body.prompt is not None:
        chars = len(body.prompt)
    else:
        chars = sum(len(m.plain()["content"]) for m in body.messages or ())
    if chars > limit:
        raise ApiError(413, f"{param}: longer than {limit} characters (SLUICE_MAX_PROMPT_CHARS)", param=param,
                       code="request_too_large")
    tokenizer, context = await _tokenizer(s, model)
    if body.messages is not None:
        require_unicode([m.content for m in body.messages], "messages")
        # transformers reads files: in a thread
        chat = await asyncio.to_thread(s.intake.prompt_limits.chat_template, model)
        assert chat is not None  # its tokenizer was read: the model's files are on this host
        try:
            text = await asyncio.to_thread(chat.apply_chat_template, [m.plain() for m in body.messages],
                                           tokenize=False, add_generation_prompt=body.add_generation_prompt)
        except (TemplateError, ValueError, TypeError, IndexError) as err:  # the template refuses them
            raise ApiError(400, f"messages: the model's chat template cannot render them: {err}"[:500],
                           param="messages") from err
        special = bool(body.add_special_tokens)  # the template wrote them already (vLLM's default for chat)
    else:
        require_unicode(body.prompt, "prompt")
        text, special = body.prompt, body.add_special_tokens is not False
    encoded = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=special)
    out = {"count": len(encoded.ids), "max_model_len": context, "tokens": encoded.ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = encoded.tokens
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: ApiState = Depends(state)) -> dict:
    model = await s.deployments.get(body.model)
    tokenizer, _ = await _tokenizer(s, model)
    vocab = tokenizer.get_vocab_size()
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})",
                       param="tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)}
