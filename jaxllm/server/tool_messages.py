"""Earlier tool calls and their results, as the chat template reads them.

OpenAI's messages carry a call's arguments as a JSON string; transformers' chat templates (Qwen2.5/3,
Llama 3.1, Hermes, Mistral) write them with `arguments | tojson` or loop over them, so they expect the
object: a string would come out quoted twice. Each assistant message's `tool_calls[j].function.arguments`
is therefore parsed here (400 naming it when it is not JSON), as vLLM does for transformers templates;
`tool` messages keep their `tool_call_id` (and `name`), which templates use to pair results with calls.
"""

from __future__ import annotations

import json
from typing import Any

from jaxllm.server.errors import APIError


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages with every tool call's arguments as an object; the rest unchanged."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            out.append(m)
            continue
        out.append({**m, "tool_calls": [_template_call(i, j, c) for j, c in enumerate(_list(i, calls))]})
    return out


def _list(i: int, calls: Any) -> list:
    if not isinstance(calls, list):
        raise APIError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
    return calls


def _template_call(i: int, j: int, call: Any) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError(
            f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where
        )
    fn = call["function"]
    if not isinstance(fn.get("name"), str):
        raise APIError(f"{where}.function.name must be a string", param=f"{where}.function.name")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise APIError(
                f"{where}.function.arguments is not valid JSON ({e.msg} at position {e.pos})",
                param=f"{where}.function.arguments",
            ) from None
    elif args is not None and not isinstance(args, dict):
        raise APIError(
            f"{where}.function.arguments must be a JSON string", param=f"{where}.function.arguments"
        )
    return {**call, "function": {**fn, "arguments": args if args is not None else {}}}
