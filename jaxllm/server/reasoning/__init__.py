"""Reasoning parsers, chosen with vLLM's `--reasoning-parser NAME`: they split `<think>` text into the
message's `reasoning_content` (base.py says how; one file per family)."""

from __future__ import annotations

from jaxllm.server.reasoning.base import ReasoningDelta, ReasoningParser
from jaxllm.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxllm.server.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser"]
