"""A request's host-side state as it moves through the scheduler (no jax).

`num_computed_tokens` catches up with `num_tokens` (prompt + generated): there are no prefill or decode
phases, only how many new tokens a step gives a request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxllm.sampling_params import SamplingParams
from jaxllm.token_ids import slice_tokens


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; recomputes (or swaps in) when rescheduled
    SWAPPED = 3  # KV blocks live in host memory
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # The seed of this request's random stream: the k-th generated token is drawn with key(sampling_seed, k),
    # so a seeded request gives the same tokens whatever else shares its batch.
    sampling_seed: int = 0
    max_tokens: int = 16  # resolved: min(params.max_tokens, max_model_len - prompt length)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when a step is scheduled (its KV is written by that step)
    # Tokens a scheduled step will sample but that have not come back yet (with async scheduling, up to
    # two: the step in flight and the one scheduled behind it). The scheduler counts them as known.
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens at first scheduling (-1: not yet scheduled)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Speculative decoding: tokens proposed for the next step (jaxllm/spec_decode/; the scheduler consumes
    # them), and how many were proposed and accepted over the request's life.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        return slice_tokens(self.prompt_token_ids, self.output_token_ids, start, stop)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
