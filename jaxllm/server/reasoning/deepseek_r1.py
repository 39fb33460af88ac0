"""DeepSeek-R1 (`--reasoning-parser deepseek_r1`): its chat template ends the prompt with `<think>\n`, so
the output starts inside the reasoning and `</think>` ends it (older R1 templates leave `<think>` to the
model, which writes it first: then it is dropped). No `</think>`: all of the output is reasoning."""

from __future__ import annotations

from jaxllm.server.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
