"""Per-request sampling parameters (vLLM's `SamplingParams`), validated on construction.

Host-only: no jax here. The runner turns a batch of these into device arrays (runner/sampler.py).
`output_kind` says which RequestOutputs the engine builds for the request (engine/output_processor.py).

Constraints on which tokens may be drawn (vLLM's fields): `structured_outputs` (a JSON schema, any JSON
object, a regex, a choice of strings or an EBNF/Lark grammar: jaxllm/structured_output/),
`allowed_token_ids`, `bad_words` (resolved to token ids by the engine) and `logit_bias`; all of them reach
the device sampler as one per-row token mask plus a sparse bias.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from jaxllm.research_params import ResearchParams

_GREEDY_EPS = 1e-5
_F32_MAX = 3.4e38


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names).

    CUMULATIVE: everything so far (whole text, all token ids and logprobs), after every step.
    DELTA: only what is new since the request's previous output: per sample the new text, token ids and
        logprob positions, its finish reason once; prompt logprobs with the first output. For streaming.
    FINAL_ONLY: one output, when every sample has finished, with everything. For batch use.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text (vLLM's `StructuredOutputsParams`).

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: an EBNF grammar
    (GBNF, as llama.cpp writes it, or Lark). `disable_any_whitespace` asks for compact JSON."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string")
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    priority: int = 0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (before any other step)
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    bad_words: list[str] | None = None  # words that may not be generated (the engine tokenizes them)
    # activations to capture and steering to apply inside the compiled step (jaxllm/research_params.py)
    research: ResearchParams | None = None
    stop_list: list[str] = field(init=False, default_factory=list, repr=False)
    # bad_words as token ids, set by the engine, which has the tokenizer (LLMEngine.prepare_request).
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop] if self.stop else []
        elif self.stop is None:
            self.stop_list = []
        else:
            if not all(isinstance(s, str) for s in self.stop):
                raise ValueError(f"stop={self.stop!r} must be a string or a list of strings")
            self.stop_list = [s for s in self.stop if s]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except (ValueError, TypeError):
                raise ValueError(
                    f"output_kind={self.output_kind!r} must be a RequestOutputKind "
                    f"({', '.join(k.name for k in RequestOutputKind)})"
                ) from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.research, dict):
            self.research = ResearchParams(**self.research)
        if self.research is not None and not (self.research.capture or self.research.edits_model):
            self.research = None
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise ValueError(f"logit_bias={self.logit_bias!r} must map token ids to numbers") from None
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.n, int) and self.n >= 1, f"n={self.n} must be an integer >= 1")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            v = getattr(self, name)
            # The sampler computes in float32: a larger value would become inf there.
            check(
                isinstance(v, int | float) and math.isfinite(v) and abs(v) <= _F32_MAX,
                f"{name}={v} must be a finite number (the sampler computes in float32)",
            )
        check(self.temperature >= 0.0, f"temperature={self.temperature} must be >= 0")
        check(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1]")
        check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
            f"top_k={self.top_k} must be -1 (disabled), 0 (disabled) or a positive integer",
        )
        check(0.0 <= self.min_p <= 1.0, f"min_p={self.min_p} must be in [0, 1]")
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty={self.presence_penalty} must be in [-2, 2]",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]",
        )
        check(self.repetition_penalty > 0.0, f"repetition_penalty={self.repetition_penalty} must be > 0")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens={self.max_tokens} must be an integer >= 1",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens={self.min_tokens} must be an integer >= 0",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs={self.logprobs} must be an integer in [0, 20]",
        )
        check(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            f"prompt_logprobs={self.prompt_logprobs} must be an integer in [0, 20]",
        )
        check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            f"seed={self.seed} must be a non-negative integer",
        )
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids={self.stop_token_ids} must be non-negative integers",
        )
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs={self.structured_outputs!r} must be a StructuredOutputsParams",
        )
        check(
            self.logit_bias is None
            or all(k >= 0 and math.isfinite(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()),
            f"logit_bias={self.logit_bias} must map non-negative token ids to numbers in [-100, 100]",
        )
        check(
            self.allowed_token_ids is None
            or (
                len(self.allowed_token_ids) > 0
                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)
            ),
            f"allowed_token_ids={self.allowed_token_ids} must be a non-empty list of non-negative integers",
        )
        check(
            self.bad_words is None or all(isinstance(w, str) and w for w in self.bad_words),
            f"bad_words={self.bad_words} must be a list of non-empty strings",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def constrains_tokens(self) -> bool:
        """Some row-specific rule decides which tokens may be drawn (the sampler's token mask)."""
        return (
            self.structured_outputs is not None or self.allowed_token_ids is not None or bool(self.bad_words)
        )

    def clone(self, **changes) -> SamplingParams:
        kw = {f: getattr(self, f) for f in self.__dataclass_fields__ if self.__dataclass_fields__[f].init}
        kw.update(changes)
        return SamplingParams(**kw)
