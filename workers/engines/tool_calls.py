"""Tool calls in a finished chat output, found by one of vLLM's tool-call parsers (the
deployment's `tool_call_parser`), as vLLM's server does for `tool_choice: "auto"`."""

from __future__ import annotations

from typing import Any


def parse_tool_calls(tokenizer: Any, parser: str, text: str, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None] | None:
    """(tool calls in OpenAI's shape, the content beside them), or None when the output calls
    no tool."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest(model="sluice", messages=messages, tools=tools, tool_choice="auto")
    found = ToolParserManager.get_tool_parser(parser)(tokenizer).extract_tool_calls(text, request)
    if not found.tools_called:
        return None
    calls = [{"id": call.id, "type": "function",
              "function": {"name": call.function.name, "arguments": call.function.arguments}}
             for call in found.tool_calls]
    return calls, found.content or None
