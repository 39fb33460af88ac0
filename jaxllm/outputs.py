"""What the engine hands back to users: `RequestOutput` with one `CompletionOutput` per sample.

Host-only types (no jax), shaped like vLLM's so code written for vLLM reads them unchanged. What an
output holds depends on the request's `SamplingParams.output_kind`: everything so far (CUMULATIVE), what
is new since the request's previous output (DELTA), or everything once at the end (FINAL_ONLY). Once
handed out, an output is the caller's: the engine never changes it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank of this token in the distribution
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class Captures:
    """Activations a request captured (SamplingParams.research): `arrays[site]` holds one row per entry
    of `positions` (the model's input positions, ascending), [P, H] in the model's dtype, f32[P, V] for
    "logits"."""

    positions: list[int]
    arrays: dict  # site name -> np.ndarray


@dataclass(slots=True)
class CompletionOutput:
    """One sample. DELTA: `text`, `token_ids` and `logprobs` are what is new since this sample's previous
    output, and `finish_reason` is set in the one output that reports the end; a DELTA RequestOutput lists
    a sample only when it has something new (its first output lists every sample)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # over all tokens so far, whatever the kind
    logprobs: list[PositionLogprobs] | None = None  # one per token of `token_ids`
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    captures: Captures | None = None  # research captures (DELTA: the positions new since the last output)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding, over all the request's samples: tokens proposed, and accepted of them
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """One request (all its samples). `prompt_logprobs`: with every output (CUMULATIVE), the first
    (DELTA) or the only one (FINAL_ONLY); None in the others. `metrics` is a copy as of this output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
