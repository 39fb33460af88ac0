"""Tool-call parsers by family, chosen with vLLM's `--tool-call-parser NAME` (and
`--enable-auto-tool-choice`, which lets tool_choice "auto" use it): each turns a model's output into
content and OpenAI `tool_calls`, whole (`extract`) or as stream deltas (`feed` / `finish`).

    hermes, qwen   <tool_call>{"name": ..., "arguments": {...}}</tool_call>       (hermes.py)
    llama3_json    <|python_tag|>{"name": ..., "parameters": {...}}; {...}        (llama3_json.py)
    mistral        [TOOL_CALLS][{...}, ...]   or   [TOOL_CALLS]name[ARGS]{...}     (mistral.py)
"""

from __future__ import annotations

from jaxllm.server.tool_parsers.base import ExtractedToolCalls, ParserDelta, ToolCall, ToolParser
from jaxllm.server.tool_parsers.hermes import HermesToolParser, QwenToolParser
from jaxllm.server.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxllm.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, QwenToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParserDelta", "ToolCall", "ToolParser"]
