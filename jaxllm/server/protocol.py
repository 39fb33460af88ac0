"""Request parsing: a JSON body (already decoded) -> a typed request, or an `APIError` naming the field.

Unknown fields are ignored (SDKs send extras); known fields are type-checked here, ranges are checked by
`SamplingParams` itself (its `ValueError` becomes a 400 in the handlers). Completions take `prompt` as a
string, a list of strings, a list of token ids or a list of token-id lists; chat takes `messages`.
Fields a client leaves out (absent or null) first take the model's sampling defaults
(`with_sampling_defaults`, --generation-config), then the OpenAI defaults written below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jaxllm.server.errors import APIError

_MISSING = object()
MAX_N = 128  # samples per prompt; more is almost certainly a mistake and would flood the engine
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _bad(name: str, what: str) -> APIError:
    return APIError(f"'{name}' must be {what}", status=400, param=name)


def get_int(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, "an integer")
    return v


def get_float(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(name, "a number")
    if not math.isfinite(v):
        raise _bad(name, "a finite number")
    return float(v)


def get_bool(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "a boolean")
    return v


def get_str(body: dict, name: str, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, str):
        raise _bad(name, "a string")
    return v


def with_sampling_defaults(body: dict, defaults: dict, *, chat: bool) -> dict:
    """`body` with each default (a SamplingParams field: temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens) filled in where the client left that field out; explicit values are
    kept. For chat, `max_completion_tokens` counts as giving max_tokens."""
    if not defaults:
        return body
    out = dict(body)
    for name, value in defaults.items():
        given = out.get(name) is not None or (
            chat and name == "max_tokens" and out.get("max_completion_tokens") is not None
        )
        if not given:
            out[name] = value
    return out


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


@dataclass(slots=True)
class CommonFields:
    """Fields shared by chat and completions; `sampling` holds SamplingParams keyword arguments."""

    model: str | None
    stream: bool
    include_usage: bool
    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None  # None: what the context leaves
    user: str | None = None


def parse_common(body: dict) -> CommonFields:
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _bad("stop", "a string or a list of strings")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not _is_token_ids(stop_token_ids):
        raise _bad("stop_token_ids", "a list of integers")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _bad("stream_options", "an object")
    include_usage = get_bool(stream_options or {}, "include_usage", False)
    sampling = {
        "n": get_int(body, "n", 1),
        "temperature": get_float(body, "temperature", 1.0),
        "top_p": get_float(body, "top_p", 1.0),
        "top_k": get_int(body, "top_k", -1),
        "min_p": get_float(body, "min_p", 0.0),
        "presence_penalty": get_float(body, "presence_penalty", 0.0),
        "frequency_penalty": get_float(body, "frequency_penalty", 0.0),
        "repetition_penalty": get_float(body, "repetition_penalty", 1.0),
        "seed": get_int(body, "seed"),
        "stop": stop,
        "stop_token_ids": list(stop_token_ids or []),
        "ignore_eos": get_bool(body, "ignore_eos", False),
        "min_tokens": get_int(body, "min_tokens", 0),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", False),
    }
    if not 1 <= sampling["n"] <= MAX_N:
        raise APIError(f"n={sampling['n']} must be in [1, {MAX_N}]", param="n")
    best_of = get_int(body, "best_of")
    if best_of is not None and best_of != sampling["n"]:
        raise APIError("'best_of' different from 'n' is not supported", param="best_of")
    return CommonFields(
        model=get_str(body, "model"),
        stream=get_bool(body, "stream", False),
        include_usage=include_usage,
        sampling=sampling,
        user=get_str(body, "user"),
    )


@dataclass(slots=True)
class CompletionRequest:
    common: CommonFields
    prompts: list[str | list[int]]  # one entry per prompt: text or token ids
    echo: bool = False
    logprobs: int | None = None


def parse_completion(body: dict) -> CompletionRequest:
    common = parse_common(body)
    common.max_tokens = get_int(body, "max_tokens", 16)
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise APIError("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_token_ids(prompt) and prompt:
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_ids(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise _bad(
            "prompt", "a non-empty string, list of strings, list of token ids or list of token-id lists"
        )
    if body.get("suffix") is not None:
        raise APIError("'suffix' is not supported", param="suffix")
    return CompletionRequest(
        common=common, prompts=prompts, echo=get_bool(body, "echo", False), logprobs=get_int(body, "logprobs")
    )


@dataclass(slots=True)
class ChatRequest:
    common: CommonFields
    messages: list[dict]  # [{"role": str, "content": str}] with content parts flattened to text
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)


def _content_text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(
                    f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}; other part types are not supported",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", "a string or a list of content parts")


def parse_chat(body: dict) -> ChatRequest:
    common = parse_common(body)
    max_completion = get_int(body, "max_completion_tokens")
    common.max_tokens = max_completion if max_completion is not None else get_int(body, "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"messages[{i}].role={role!r} must be one of {CHAT_ROLES}", param="messages")
        msg = {"role": role, "content": _content_text(i, m.get("content"))}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        for key in ("tool_calls", "tool_call_id"):  # checked where they are used (server/tool_messages.py)
            if m.get(key) is not None:
                msg[key] = m[key]
        parsed.append(msg)
    logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise APIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object")
    return ChatRequest(
        common=common,
        messages=parsed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        add_generation_prompt=get_bool(body, "add_generation_prompt", True),
        continue_final_message=get_bool(body, "continue_final_message", False),
        chat_template_kwargs=kwargs,
    )


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool


def parse_tokenize(body: dict) -> TokenizeRequest:
    model = get_str(body, "model")
    if "messages" in body:
        chat = parse_chat({"messages": body.get("messages")})
        return TokenizeRequest(model, None, chat.messages, get_bool(body, "add_special_tokens", False))
    prompt = get_str(body, "prompt")
    if prompt is None:
        raise APIError("'prompt' (a string) or 'messages' is required", param="prompt")
    return TokenizeRequest(model, prompt, None, get_bool(body, "add_special_tokens", True))


def parse_detokenize(body: dict) -> tuple[str | None, list[int]]:
    tokens = body.get("tokens")
    if not _is_token_ids(tokens):
        raise _bad("tokens", "a list of integers")
    return get_str(body, "model"), tokens
