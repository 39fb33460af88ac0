"""What the scheduler tells the runner for one step (host only: ints, lists).

Requests are listed decode-first then prefill chunks; each gets `num_new_tokens` tokens starting at
`request.num_computed_tokens` (the value before this step). The runner samples a token for a request
when the step reaches the end of its known tokens (`start + num_new_tokens == request.num_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # request.num_computed_tokens when scheduled
    block_ids: list[int]  # the request's whole block table, in order

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens >= self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    # KV swapping between device and host (swap_space > 0): (device block, host block) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in
