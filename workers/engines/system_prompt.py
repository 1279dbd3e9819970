"""An example custom runtime: an extra `system_prompt` input, rendered with the model's
chat template, and an extra `num_words` output."""

from __future__ import annotations

from typing import Any

from sluice.workers.engines.custom import CustomRuntime


class SystemPromptRuntime(CustomRuntime):
    default_system_prompt = "You are a helpful assistant."

    def prompt_for(self, row: dict[str, Any]) -> str:
        messages = [
            {"role": "system", "content": row.get("system_prompt") or self.default_system_prompt},
            {"role": "user", "content": row["prompt"]},
        ]
        return self.render_chat(messages)

    def extra_outputs(self, row: dict[str, Any], text: str, num_output_tokens: int) -> dict[str, Any]:
        return {"num_words": len(text.split())}
