"""The vLLM engine adapter's start (issue 30, defects 9 and 10).

It loads what the first request asking for log probabilities would otherwise wait for (that
request took 7.7 s, the next 0.1 s; vLLM compiles its logprob ranking kernel then): start()
returns only once a generation asking for the output's and the prompt's log probabilities has run
to its end. vLLM's engine is faked here (a real one takes minutes to start on a CPU); the kernel
the warm-up is for is checked to be the installed vLLM's. And it warns only about engine options
a deployment set.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from sluice.config.engine import VLLMConfig
from sluice.workers.engines import vllm as vllm_engine
from sluice.workers.engines.base import GenerationRequest

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")


class FakeAsyncLLM:
    """AsyncLLMEngine's generate(): one token with its log probabilities, then finished."""

    def __init__(self, stat_loggers: list[object] | None = None) -> None:
        self.requests: list[tuple[str, object]] = []
        self.finished: list[str] = []
        self.stat_loggers = stat_loggers or []

    @classmethod
    def from_engine_args(cls, _args: object, stat_loggers: list[object] | None = None) -> FakeAsyncLLM:
        return cls(stat_loggers)

    async def generate(self, prompt, params, request_id: str, priority: int = 0):
        self.requests.append((request_id, params))
        chosen = SimpleNamespace(rank=1, logprob=-0.1, decoded_token=" x")
        yield SimpleNamespace(outputs=[SimpleNamespace(text=" x", token_ids=[7], finish_reason="length",
                                                       logprobs=[{7: chosen}])],
                              finished=True, prompt_token_ids=[5, 7], prompt_logprobs=[None, {7: chosen}])
        self.finished.append(request_id)

    async def abort(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> vllm_engine.VLLMEngine:
    monkeypatch.setattr(vllm, "AsyncLLMEngine", FakeAsyncLLM)
    monkeypatch.setattr(vllm, "AsyncEngineArgs", lambda **kwargs: kwargs)
    monkeypatch.setattr(vllm_engine, "engine_args", lambda path, config: ({"model": path}, []))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda _path: FakeTokenizer())
    return vllm_engine.VLLMEngine("/models/m", VLLMConfig())


async def test_logprobs_are_loaded_before_the_first_request(engine: vllm_engine.VLLMEngine) -> None:
    assert engine.warmed_up == []
    await engine.start()
    fake = engine._engine
    assert engine.warmed_up == ["logprobs", "prompt_logprobs"]
    [(request_id, params)] = fake.requests  # the warm-up, before any request
    assert params.logprobs == 1 and params.prompt_logprobs == 1
    assert fake.finished == [request_id]  # run to its end: start() waited for it

    # The first request then finds the engine warm, and gets its log probabilities.
    deltas = [d async for d in engine.generate(GenerationRequest(request_id="r1", prompt="hi", max_tokens=1,
                                                                 logprobs=1))]
    assert deltas[0].logprobs[0].logprob == -0.1
    assert [rid for rid, _ in fake.requests] == [request_id, "r1"]


async def test_the_engine_is_given_the_prefix_cache_stat_logger(engine: vllm_engine.VLLMEngine) -> None:
    """Its counters are the worker's (issue 34): the logger vLLM is handed adds to them."""
    await engine.start()
    (factory,) = engine._engine.stat_loggers
    assert issubclass(factory, vllm.v1.metrics.loggers.StatLoggerBase)
    assert engine.prefix_cache_counters() is engine.prefix_counters
    assert vllm_engine.VLLMEngine("/m", VLLMConfig(enable_prefix_caching=False)).prefix_cache_counters() is None


def test_the_warm_up_is_for_a_kernel_the_installed_vllm_compiles_lazily() -> None:
    """vLLM ranks logprobs with a torch.compile'd function, compiled at its first call: if a vLLM
    drops or moves it, what the warm-up is for (workers/engines/vllm.py, WARM_UP) must be looked at
    again."""
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    assert hasattr(batched_count_greater_than, "_torchdynamo_orig_callable")


def test_only_the_options_a_deployment_sets_are_reported_as_unknown() -> None:
    """VLLMConfig's own default for an option this vLLM no longer has (max_seq_len_to_capture) is
    dropped quietly; the same option set in the models file is reported (issue 30, defect 10: a
    warning at every worker start that no one could act on)."""
    from vllm import AsyncEngineArgs

    if "max_seq_len_to_capture" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
        pytest.skip("this vLLM still has max_seq_len_to_capture")
    kwargs, ignored = vllm_engine.engine_args("/models/m", VLLMConfig())
    assert ignored == [] and "max_seq_len_to_capture" not in kwargs
    _, ignored = vllm_engine.engine_args("/models/m", VLLMConfig(max_seq_len_to_capture=4096,
                                                                extra_engine_args={"no_such_option": 1}))
    assert ignored == ["max_seq_len_to_capture", "no_such_option"]
