"""What the runner returns for one step (host only: lists and numpy arrays)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at one or more positions: column 0 is the chosen token, then the top-N."""

    token_ids: np.ndarray  # i32[P, 1 + N]
    logprobs: np.ndarray  # f32[P, 1 + N]
    ranks: np.ndarray  # i32[P, 1 + N] (1-based rank in the distribution)


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    # One entry per scheduled request, in the scheduler's order: [] when the step did not sample for it
    # (a prefill chunk that does not reach the end of the prompt).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # requests that asked, P = 1
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # the chunk's positions
    # research: request id -> site name -> (positions, array [P, H] or f32[P, V] for logits) of this step
    captures: dict[str, dict[str, tuple[list[int], np.ndarray]]] = field(default_factory=dict)
