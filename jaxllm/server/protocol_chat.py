"""The body of POST /v1/chat/completions: messages, tools, and the chat-only fields over SamplingBody.

Messages keep what a chat template reads (role, content as text, name, an assistant's tool_calls and
reasoning_content, a tool message's tool_call_id); content parts are text only. Tools are typed and
checked here (a named tool_choice must be one of `tools`); what the model does with them is decided
downstream. See docs/openai_api.md for the fields served and refused.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from jaxllm.server.protocol_common import (
    FieldError,
    NonEmptyStr,
    RequestModel,
    SamplingBody,
    check_logprobs_limit,
)
from jaxllm.server.protocol_research import ResearchFields

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Content part types of OpenAI's API that carry media: refused with their own message (text-only server).
MEDIA_PART_TYPES = ("image_url", "input_audio", "file", "audio_url", "video_url", "input_image")


def _one_of(*variants: dict):
    """json_schema_extra that adds `variants` as the object's oneOf: what the validators below check,
    said in /openapi.json too, so a client generated from it (or a fuzzer) builds valid objects."""

    def extra(schema: dict) -> None:
        schema["oneOf"] = list(variants)

    return extra


_NOT_NULL = {"not": {"type": "null"}}


class ContentPart(RequestModel):
    model_config = ConfigDict(
        json_schema_extra=_one_of(
            {"properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["text"]},
            {
                "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
                "required": ["refusal"],
            },
        )
    )
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant message's refusal part

    @model_validator(mode="after")
    def _text_only(self):
        if self.type in MEDIA_PART_TYPES:
            raise FieldError("type", f"content parts of type {self.type!r} are not served (text only)")
        if self.type not in ("text", "refusal"):
            raise FieldError("type", f"{self.type!r} must be 'text'")
        if getattr(self, self.type) is None:
            raise FieldError(self.type, f"is required in a {self.type!r} part")
        return self

    @property
    def value(self) -> str:
        return self.text if self.type == "text" else self.refusal


class FunctionCall(RequestModel):
    name: NonEmptyStr
    arguments: str  # JSON text, as the model wrote it


class ToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    model_config = ConfigDict(
        json_schema_extra=_one_of(
            {
                "properties": {
                    "role": {"enum": ["system", "developer", "user"]},
                    "content": _NOT_NULL,
                    "tool_calls": {"type": "null"},
                },
                "required": ["content"],
            },
            {
                "properties": {
                    "role": {"const": "tool"},
                    "content": _NOT_NULL,
                    "tool_calls": {"type": "null"},
                    "tool_call_id": {"type": "string"},
                },
                "required": ["content", "tool_call_id"],
            },
            {"properties": {"role": {"const": "assistant"}}},
        )
    )
    unserved: ClassVar = {
        "audio": ("audio output is not served", ()),
        "function_call": ("the legacy function_call is not served; use tool_calls", ()),
    }
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: a reasoning model's earlier thinking

    @model_validator(mode="after")
    def _by_role(self):
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"is required in a {self.role!r} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise FieldError("tool_call_id", "is required in a 'tool' message")
        return self

    def template_dict(self) -> dict:
        """What the chat template sees: plain JSON values, content flattened to text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.value for p in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls is not None:
            msg["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


class FunctionDefinition(RequestModel):
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: NonEmptyStr


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionBody(SamplingBody, ResearchFields):
    """POST /v1/chat/completions."""

    unserved: ClassVar = {
        **SamplingBody.unserved,
        "audio": ("audio output is not served", ()),
        "prediction": ("predicted outputs are not served", ()),
        "web_search_options": ("web search is not served", ()),
        "functions": ("the legacy functions are not served; use tools", ()),
        "function_call": ("the legacy function_call is not served; use tool_choice", ()),
        "reasoning_effort": ("reasoning effort is not served", ()),
        "verbosity": ("verbosity is not served", ()),
        "echo": ("echoing the last message is not served on chat", (False,)),
        "add_special_tokens": ("the chat template decides the special tokens", (False,)),
        "documents": ("documents for the chat template are not served", ()),
        "chat_template": ("the chat template is the server's (--chat-template)", ()),
    }
    no_effect: ClassVar = (
        *SamplingBody.no_effect,
        "store",
        "metadata",
        "service_tier",
        "modalities",
        "prompt_cache_key",
        "safety_identifier",
    )
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # no effect on the output
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's chat extras
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_limit(cls, v, info):
        return check_logprobs_limit("top_logprobs", v, info.context)

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "requires logprobs: true")
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldError("continue_final_message", "and add_generation_prompt cannot both be true")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise FieldError("tool_choice", f"{_choice_text(choice)} requires tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise FieldError(
                    "tool_choice",
                    f"names the function {choice.function.name!r}, which is not in tools {names}",
                )
        return self


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"the function {choice.function.name!r}"
