"""Prefix keys (issue 34): chained hashes of a prompt's leading KV-cache blocks, computed at
admission from the tokens the context check counts, carried in the entry. The model here has a
word-level tokenizer the api can read (one word, one token: w<i> is token i) and a chat template
that puts a 16-word header (one block) before the messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from sluice.protocol.messages import RequestMessage
from sluice.protocol.prefix import PREFIX_DEPTHS, block_hashes, prefix_group, prefix_keys
from tests.api.conftest import StartApi, http_client
from tests.api.test_model_bounds import tiny_model

HEADER = " ".join(f"w{i}" for i in range(81, 97))  # 16 words: one block of the chat template's own
TEMPLATE = ("{% for m in messages %}" + HEADER + " {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}w99{% endif %}")


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def chat_model(directory: Path) -> Path:
    tiny_model(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}))
    return directory


# -- the keys themselves

def test_prompts_sharing_leading_blocks_share_those_keys_and_no_deeper_one() -> None:
    shared = list(range(1, 33))  # two blocks of 16
    a, b = prefix_keys(shared + list(range(40, 80))), prefix_keys(shared + list(range(80, 120)))
    assert len(a) == len(b) == 3  # 72 tokens: 4 full blocks, keys at depths 1, 2, 4
    assert a[:2] == b[:2] and a[2] != b[2]


def test_a_different_first_block_changes_every_key() -> None:
    a = list(range(1, 70))
    b = [99] + a[1:]
    assert not set(prefix_keys(a)) & set(prefix_keys(b))


def test_only_full_blocks_count_and_keys_are_chained() -> None:
    assert prefix_keys(list(range(15))) == []  # less than a block: nothing an engine caches
    assert prefix_keys(list(range(16))) == prefix_keys(list(range(31)))  # the partial second block adds none
    chain = block_hashes(list(range(64)), 16)
    # block 2's key covers blocks 0..2: the same block after a different first block hashes differently
    other = block_hashes([7] * 16 + list(range(16, 64)), 16)
    assert chain[2] != other[2] and len(chain) == 4


def test_keys_depend_on_the_block_size_and_stay_small() -> None:
    tokens = list(range(4096))
    assert prefix_keys(tokens, 16)[0] != prefix_keys(tokens, 32)[0]
    keys = prefix_keys(tokens, 16)
    assert len(keys) == len(PREFIX_DEPTHS) and all(len(k) == 12 for k in keys)


def test_the_group_is_the_deepest_key_within_its_blocks() -> None:
    keys = prefix_keys(list(range(1000)))  # every depth: 1, 2, 4, 8, 16, 32
    assert prefix_group(keys, 16) == keys[4] and prefix_group(keys, 10) == keys[3]
    assert prefix_group(keys[:2], 16) == keys[1]  # a short prompt: its deepest key
    assert prefix_group(keys, 0) == keys[0] and prefix_group([], 16) is None


# -- at admission

def _models(path: Path, affinity: bool = True) -> str:
    return (f"models:\n  - name: tiny\n    path: {path}\n    default_max_tokens: 16\n"
            f"    prefix_affinity: {str(affinity).lower()}\n")


def recorded(app: FastAPI) -> list[RequestMessage]:
    """The messages the app's intake hands its admission from now on (then admitted as ever):
    what the entries carry, wherever the admission puts them."""
    admission, seen = app.state.sluice.intake.admission, []
    submit, submit_many = admission.submit, admission.submit_many

    def see(messages: list[RequestMessage]) -> None:
        seen.extend(m for m in messages if all(m.id != s.id for s in seen))  # one may call the other

    async def one(message: RequestMessage, **kw):  # type: ignore[no-untyped-def]
        see([message])
        return await submit(message, **kw)

    async def many(messages: list[RequestMessage], **kw):  # type: ignore[no-untyped-def]
        see(messages)
        return await submit_many(messages, **kw)

    admission.submit, admission.submit_many = one, many
    return seen


@pytest.fixture
async def app(start_api: StartApi, tmp_path: Path) -> AsyncIterator[FastAPI]:
    async with start_api(_models(chat_model(tmp_path / "tiny")), max_wait_s=0.05) as built:
        yield built


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(app) as client:
        yield client


async def test_entries_carry_the_keys_of_their_prompt_tokens(app: FastAPI, api: httpx.AsyncClient) -> None:
    entries = recorded(app)
    shared = list(range(1, 33))
    for tail in (range(40, 72), range(60, 92)):
        r = await api.post("/v1/completions", json={"model": "tiny", "prompt": words(*shared, *tail)})
        assert r.status_code in (200, 504), r.text  # queued (no worker runs)
    r = await api.post("/v1/completions", json={"model": "tiny", "prompt": words(1, 2, 3)})  # under a block
    first, second, short = entries
    assert first.prefix == prefix_keys([*shared, *range(40, 72)])
    assert first.prefix_tokens == second.prefix_tokens == 64 and short.prefix_tokens == 3  # their sizes, for placement
    assert first.prefix[:2] == second.prefix[:2] and first.prefix[2] != second.prefix[2]
    assert short.prefix == []


async def test_the_n_choices_of_a_prompt_share_its_keys(app: FastAPI, api: httpx.AsyncClient) -> None:
    found = recorded(app)
    r = await api.post("/v1/completions", json={"model": "tiny", "prompt": words(*range(1, 40)), "n": 3})
    assert r.status_code in (200, 504), r.text
    assert len(found) == 3 and all(e.prefix == prefix_keys(list(range(1, 40))) for e in found)


async def test_a_chat_s_keys_are_those_of_its_rendered_template(app: FastAPI, api: httpx.AsyncClient) -> None:
    """The contents alone (one word) fill no block; as the template renders them (the header
    first), they fill one, and the key is that of the rendered tokens."""
    entries = recorded(app)
    for content in ("w3", "w4"):
        r = await api.post("/v1/chat/completions",
                           json={"model": "tiny", "messages": [{"role": "user", "content": content}]})
        assert r.status_code in (200, 504), r.text
    a, b = entries
    header = list(range(81, 97))
    assert a.prefix == prefix_keys([*header, 3, 99]) == prefix_keys(header) == b.prefix
    assert a.prefix_tokens == len([*header, 3, 99])


async def test_without_affinity_no_keys_are_computed(start_api: StartApi, tmp_path: Path) -> None:
    async with start_api(_models(chat_model(tmp_path / "tiny"), affinity=False), max_wait_s=0.05) as app:
        entries = recorded(app)
        async with http_client(app) as client:
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": words(*range(1, 40))})
            assert r.status_code in (200, 504), r.text
    (entry,) = entries
    assert entry.prefix == [] and entry.prefix_tokens == 0


async def test_a_tokenizer_written_after_the_api_started_is_found(start_api: StartApi, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's files are written by the first worker to start, often after the api
    has started (`sluice up` on a fresh machine): the api, not finding them, looks again a few
    seconds later instead of going without a tokenizer (no prefix keys, no context check,
    /tokenize 501) until it restarts."""
    from sluice.protocol import tokens

    async with start_api(_models(tmp_path / "tiny"), max_wait_s=0.05) as app:
        entries = recorded(app)
        async with http_client(app) as client:
            body = {"model": "tiny", "prompt": words(*range(1, 40))}
            assert (await client.post("/v1/completions", json=body)).status_code in (200, 504)
            assert (await client.post("/tokenize", json=body)).status_code == 501
            chat_model(tmp_path / "tiny")  # the worker has prepared the model
            assert (await client.post("/v1/completions", json=body)).status_code in (200, 504)
            monkeypatch.setattr(tokens, "MISSING_S", 0.0)  # (the few seconds have passed)
            assert (await client.post("/v1/completions", json=body)).status_code in (200, 504)
            assert (await client.post("/tokenize", json=body)).json()["count"] == 39
    assert [e.prefix for e in entries] == [[], [], prefix_keys(list(range(1, 40)))]
