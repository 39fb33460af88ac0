"""The body of POST /v1/completions: prompts (text or token ids), echo, logprobs, over SamplingBody.

`prompt` is a string, a list of strings, a list of token ids or a list of token-id lists (one request per
prompt); `logprobs` is the number of top logprobs per token (at most --max-logprobs); `best_of` is served
only equal to `n`; `suffix` is refused. See docs/openai_api.md.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from jaxllm.server.protocol_common import FieldError, SamplingBody, check_logprobs_limit
from jaxllm.server.protocol_research import ResearchFields

PROMPT_SHAPES = "a non-empty string, list of strings, list of token ids or list of token-id lists"


def _is_token_ids(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionBody(SamplingBody, ResearchFields):
    """POST /v1/completions."""

    unserved: ClassVar = {
        **SamplingBody.unserved,
        "suffix": ("text after the completion (fill-in-the-middle) is not served", ()),
    }
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        if v is None:
            raise ValueError(f"is required: {PROMPT_SHAPES}")
        ok = isinstance(v, str) or (
            isinstance(v, list)
            and v
            and (all(isinstance(p, str) for p in v) or _is_token_ids(v) or all(_is_token_ids(p) for p in v))
        )
        if not ok:
            raise ValueError(f"must be {PROMPT_SHAPES}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_limit(cls, v, info):
        return check_logprobs_limit("logprobs", v, info.context)

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise FieldError(
                "best_of", f"{self.best_of} differs from n={self.n or 1}; only best_of == n is served"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if _is_token_ids(p):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]
