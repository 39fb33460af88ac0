"""Qwen3 (`--reasoning-parser qwen3`): the model opens its thinking with `<think>` itself, and with
thinking switched off (`chat_template_kwargs: {"enable_thinking": false}`) writes none, so an output that
does not begin with `<think>` is all content."""

from __future__ import annotations

from jaxllm.server.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False
