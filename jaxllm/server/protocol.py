"""Request parsing: a JSON body (already decoded) -> what a handler works with, or an `APIError` naming
the field.

    body --with_sampling_defaults--> body with the model's defaults for the fields the client left out
         --parse_chat / parse_completion--> ChatRequest / CompletionRequest (CommonFields.sampling holds
         SamplingParams keyword arguments, structured_outputs included)

The body models and every check are in protocol_common.py (shared fields, errors), protocol_chat.py and
protocol_completion.py; /openapi.json is generated from the same models (openapi.py). Fields a client
leaves out (absent or null) first take the model's sampling defaults (--generation-config), then
OpenAI's defaults (SamplingBody.sampling_kwargs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from jaxllm.server.errors import APIError
from jaxllm.server.protocol_chat import CHAT_ROLES, ChatCompletionBody, ChatMessage
from jaxllm.server.protocol_common import (
    DEFAULT_MAX_LOGPROBS,
    MAX_N,
    NonNegInt,
    RequestModel,
    validate_body,
)
from jaxllm.server.protocol_completion import CompletionBody
from jaxllm.server.research import ResearchLimits

__all__ = [
    "CHAT_ROLES",
    "MAX_N",
    "ChatRequest",
    "CommonFields",
    "CompletionRequest",
    "DetokenizeBody",
    "TokenizeBody",
    "TokenizeRequest",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_tokenize",
    "with_sampling_defaults",
]


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


@dataclass(slots=True)
class CommonFields:
    """Fields shared by chat and completions; `sampling` holds SamplingParams keyword arguments."""

    model: str | None
    stream: bool
    include_usage: bool
    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None  # None: what the context leaves
    user: str | None = None
    priority: int = 0
    prompt_logprobs: int | None = None  # asked for explicitly (vLLM's extra); returned in the response
    constraint_field: str | None = None  # the field an output constraint came in, if any
    research_field: str | None = None  # "research" or "vllm_xargs.research" when given (sampling has it)
    timeout: float | None = None  # seconds: the request is aborted when they pass


def _common(b: CompletionBody | ChatCompletionBody) -> CommonFields:
    sampling = b.sampling_kwargs()
    if b.research_params is not None:
        sampling["research"] = b.research_params
    return CommonFields(
        model=b.model,
        stream=bool(b.stream),
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        sampling=sampling,
        user=b.user,
        priority=b.priority or 0,
        prompt_logprobs=b.prompt_logprobs,
        constraint_field=b.structured_field,
        research_field=b.research_field,
        timeout=b.timeout,
    )


@dataclass(slots=True)
class CompletionRequest:
    common: CommonFields
    prompts: list[str | list[int]]  # one entry per prompt: text or token ids
    echo: bool = False
    logprobs: int | None = None


def parse_completion(
    body: dict, max_logprobs: int = DEFAULT_MAX_LOGPROBS, research_limits: ResearchLimits | None = None
) -> CompletionRequest:
    b = validate_body(CompletionBody, body, max_logprobs, research_limits)
    common = _common(b)
    common.max_tokens = 16 if b.max_tokens is None else b.max_tokens
    return CompletionRequest(common=common, prompts=b.prompts(), echo=bool(b.echo), logprobs=b.logprobs)


@dataclass(slots=True)
class ChatRequest:
    common: CommonFields
    messages: list[dict]  # plain dicts for the template: role, content (text), name, tool_calls, ...
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] | None = None  # [{"type": "function", "function": {name, description?, parameters?}}]
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True


def parse_chat(
    body: dict, max_logprobs: int = DEFAULT_MAX_LOGPROBS, research_limits: ResearchLimits | None = None
) -> ChatRequest:
    b = validate_body(ChatCompletionBody, body, max_logprobs, research_limits)
    common = _common(b)
    common.max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    choice = b.tool_choice
    return ChatRequest(
        common=common,
        messages=[m.template_dict() for m in b.messages],
        logprobs=bool(b.logprobs),
        top_logprobs=b.top_logprobs,
        add_generation_prompt=True if b.add_generation_prompt is None else b.add_generation_prompt,
        continue_final_message=bool(b.continue_final_message),
        chat_template_kwargs=dict(b.chat_template_kwargs or {}),
        tools=[t.model_dump(exclude_none=True) for t in b.tools] if b.tools is not None else None,
        tool_choice=choice if choice is None or isinstance(choice, str) else choice.model_dump(),
        parallel_tool_calls=True if b.parallel_tool_calls is None else b.parallel_tool_calls,
    )


# ---- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------------------
class TokenizeBody(RequestModel):
    """POST /tokenize: `prompt` (text) or `messages` (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages


class DetokenizeBody(RequestModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[NonNegInt]


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool


def parse_tokenize(body: dict) -> TokenizeRequest:
    b = validate_body(TokenizeBody, body)
    if b.messages is not None:
        messages = [m.template_dict() for m in b.messages]
        return TokenizeRequest(b.model, None, messages, bool(b.add_special_tokens))
    if b.prompt is None:
        raise APIError("prompt: a string (or messages) is required", param="prompt")
    add = True if b.add_special_tokens is None else b.add_special_tokens
    return TokenizeRequest(b.model, b.prompt, None, add)


def parse_detokenize(body: dict) -> tuple[str | None, list[int]]:
    b = validate_body(DetokenizeBody, body)
    return b.model, list(b.tokens)


def body_models() -> dict[str, Any]:
    """The request body model of each POST route (for /openapi.json and the docs test)."""
    return {
        "/v1/chat/completions": ChatCompletionBody,
        "/v1/completions": CompletionBody,
        "/tokenize": TokenizeBody,
        "/detokenize": DetokenizeBody,
    }
