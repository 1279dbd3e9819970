"""The official openai SDK against Sluice (base_url and api_key only), on the real engine."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import MODEL, Stack, submit, wait_done

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]

PROMPT = "The capital of France is"


@pytest.fixture
def sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def native(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    rid = await submit(client, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    return (await wait_done(client, rid))["output"]


async def test_models_list(sdk: openai.AsyncOpenAI) -> None:
    ids = [m.id async for m in sdk.models.list()]
    assert MODEL in ids
    assert (await sdk.models.retrieve(MODEL)).id == MODEL


async def test_completions_equal_the_native_endpoint(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient) -> None:
    want = await native(client, PROMPT, 12)
    got = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and len(got.choices) == 1
    assert got.choices[0].text == want["text"] and got.choices[0].text.startswith(" Paris")
    assert got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.completion_tokens == want["num_output_tokens"] and got.usage.prompt_tokens > 0

    stream = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == want["text"]
    assert reasons[-1] == want["finish_reason"] and len(pieces) >= 2
    assert usage is not None and usage.completion_tokens == want["num_output_tokens"]


async def test_chat_completions_equal_the_native_endpoint(sdk: openai.AsyncOpenAI, client: httpx.AsyncClient,
                                                          stack: Stack) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    rendered = AutoTokenizer.from_pretrained(stack.model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    want = await native(client, rendered, 16)
    got = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert "Paris" in want["text"]

    stream = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                               stream=True)
    text, roles, last = [], [], None
    async for chunk in stream:
        for c in chunk.choices:
            roles.append(c.delta.role)
            text.append(c.delta.content or "")
            last = c.finish_reason or last
    assert roles[0] == "assistant" and "".join(text) == want["text"] and last == want["finish_reason"]


async def test_n_choices_and_errors(sdk: openai.AsyncOpenAI) -> None:
    got = await sdk.completions.create(model=MODEL, prompt=["Once upon a time", "In a galaxy"], n=2,
                                       max_tokens=6, temperature=0.9, seed=11)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert 0 < got.usage.completion_tokens <= 4 * 6
    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"5": 1})
    with pytest.raises(openai.UnprocessableEntityError):
        await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=-3)
