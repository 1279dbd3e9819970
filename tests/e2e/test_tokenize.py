"""vLLM's /tokenize and /detokenize on the api: the counts agree with what the engine
reports for the same prompt (text and chat), ids round-trip, and bad ids are a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Stack

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}]


async def test_tokenize_counts_what_the_engine_counts(stack: Stack) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        text = (await client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                                     "return_token_strs": True})).json()
        done = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
        assert text["count"] == len(text["tokens"]) == done.usage.prompt_tokens
        assert text["max_model_len"] == 2048 and len(text["token_strs"]) == text["count"]

        chat = (await client.post("/tokenize", json={"model": MODEL, "messages": CHAT})).json()
        done = await sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
        assert chat["count"] == done.usage.prompt_tokens > text["count"]

        back = await client.post("/detokenize", json={"model": MODEL, "tokens": text["tokens"]})
        assert back.json() == {"prompt": PROMPT}

        for path, body, param in (("/detokenize", {"model": MODEL, "tokens": [10**9]}, "tokens"),
                                  ("/tokenize", {"model": MODEL}, None),
                                  ("/tokenize", {"model": MODEL, "messages": []}, None),  # the fuzzer's 500
                                  ("/tokenize", {"model": "absent", "prompt": "x"}, "model")):
            r = await client.post(path, json=body)
            assert 400 <= r.status_code < 500, r.text
            if param:
                assert r.json()["error"]["param"] == param, r.text
