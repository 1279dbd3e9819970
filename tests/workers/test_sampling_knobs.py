"""The sampling extras are declared once (SamplingExtras, protocol/messages.py) and carried as one
object from the api to the engine (issue 30): a vLLM sampling knob added to that declaration, and
nowhere else, is taken by every surface (native, completions, chat, responses, a batch's line) and
reaches vLLM's SamplingParams with the value the client sent, as every other extra does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice.protocol.messages import Sampled, SamplingExtras
from sluice.protocol.openai import CompletionRequest
from sluice.workers.engines.base import GenerationRequest
from sluice.workers.engines.vllm import sampling_keywords
from tests.workers.added_knob import KNOB, VALUES

ROOT = Path(__file__).resolve().parents[2]


async def test_a_knob_added_to_its_one_declaration_reaches_sampling_params(redis: Redis, redis_url: str,
                                                                           jobs_broker_url: str | None,
                                                                           tmp_path: Path) -> None:
    assert KNOB not in SamplingExtras.model_fields  # added by the script's process alone
    # on a Redis Cluster, the jobs' Celery broker is a single Redis of its own (as for every test)
    run = subprocess.run([sys.executable, "-m", "tests.workers.added_knob", redis_url, str(tmp_path),
                          *([jobs_broker_url] if jobs_broker_url else [])], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert set(got) == {"native", "completions", "chat", "responses", "batch line"}
    for surface, keywords in got.items():
        assert {name: keywords.get(name) for name in VALUES} == VALUES, surface
    vllm = pytest.importorskip("vllm")
    params = vllm.SamplingParams(**got["native"])
    assert getattr(params, KNOB) is True and params.top_k == 5 and params.stop_token_ids == [7]


def test_every_extra_is_a_sampling_params_keyword() -> None:
    """What the vLLM engine builds takes each declared extra by its own name."""
    vllm = pytest.importorskip("vllm")
    sampled = Sampled(top_k=3, min_tokens=2, ignore_eos=True, stop_token_ids=[1, 2])
    keywords = sampling_keywords(GenerationRequest(request_id="r", prompt="p", max_tokens=4, sampling=sampled))
    assert set(SamplingExtras.model_fields) <= set(keywords)
    params = vllm.SamplingParams(**keywords)
    assert (params.top_k, params.min_tokens, params.ignore_eos, params.stop_token_ids) == (3, 2, True, [1, 2])


def test_a_null_extra_on_openai_bodies_is_its_default() -> None:
    """OpenAI's SDKs may send null: as before for top_k and stop_token_ids, now for every extra."""
    nulls = dict.fromkeys(SamplingExtras.model_fields)
    body = CompletionRequest.model_validate({"prompt": "p", **nulls})
    fields = body.sampling_fields()
    assert {name: fields[name] for name in nulls} == SamplingExtras().extras()
