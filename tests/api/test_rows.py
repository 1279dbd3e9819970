"""Row checks against a deployment: pure (the caller's rows are not changed), and every refusal a
4xx naming the row and field."""

from __future__ import annotations

import copy

import pytest

from sluice.api.rows import RowsRefused, checked_rows, prompt_text
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.engine import VLLMConfig
from sluice.config.model import ModelConfig

CONTINUOUS = ModelConfig(name="c", continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=4),
                         default_max_tokens=16)
DYNAMIC = ModelConfig(name="d", dynamic_batching_config=DynamicBatchingConfig(batch_size_target=2, batch_size_limit=3),
                      framework_config=VLLMConfig(max_model_len=100), default_max_tokens=8)


def test_max_tokens_is_filled_in_on_a_copy() -> None:
    rows = [{"prompt": "p"}, {"prompt": "q", "max_tokens": 5, "extra": [1]}]
    before = copy.deepcopy(rows)
    checked = checked_rows(DYNAMIC, rows, max_prompt_chars=10)
    assert rows == before  # the caller's rows are as they were
    assert checked == [{"prompt": "p", "max_tokens": 8}, {"prompt": "q", "max_tokens": 5, "extra": [1]}]
    assert checked_rows(CONTINUOUS, [{"prompt": "p", "max_tokens": None}], max_prompt_chars=10)[0]["max_tokens"] == 16


@pytest.mark.parametrize(("model", "rows", "status", "message", "reason"), [
    (CONTINUOUS, [], 400, "rows: at least one row", "no_rows"),
    (CONTINUOUS, [{"prompt": "a"}, {"prompt": "b"}], 400, "Continuous batching is not supported", "batch_size"),
    (DYNAMIC, [{"prompt": "a"}] * 4, 400, "Maximum batch size exceeded", "batch_size"),
    (CONTINUOUS, [{"prompt": "x" * 11}], 413, "prompt: longer than 10 characters", "prompt_too_long"),
    (DYNAMIC, [{"prompt": "a"}, {"prompt": "x" * 11}], 413, "rows[1].prompt: longer than 10", "prompt_too_long"),
    (DYNAMIC, [{"prompt": "a", "max_tokens": 100}], 422, "max_tokens: must be below the model's context length (100)",
     "max_tokens"),
    (DYNAMIC, [{"prompt": "a"}, {"prompt": "b", "max_tokens": 500}], 422, "rows[1].max_tokens", "max_tokens"),
    (CONTINUOUS, [{"messages": [{"role": "user", "content": "x" * 6}, {"role": "user", "content": "y" * 5}]}],
     413, "prompt: longer than 10", "prompt_too_long"),
])
def test_refusals_name_the_row_and_field(model: ModelConfig, rows: list, status: int, message: str,
                                         reason: str) -> None:
    with pytest.raises(RowsRefused) as refused:
        checked_rows(model, rows, max_prompt_chars=10)
    assert refused.value.status == status
    assert message in refused.value.message
    assert refused.value.reason == reason


def test_prompt_text_reads_prompts_and_chat_messages_and_ignores_junk() -> None:
    assert prompt_text({"prompt": "hi"}) == "hi"
    assert prompt_text({"messages": [{"role": "user", "content": "a"}, {"content": None}, "junk", 3]}) == "a"
    assert prompt_text({"messages": None}) == "" and prompt_text({}) == ""
