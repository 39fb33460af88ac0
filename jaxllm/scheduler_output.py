"""What the scheduler tells the runner for one step (host only: ints, lists).

Requests are listed decode-first then prefill chunks; each gets `num_new_tokens` tokens starting at
`start` (the request's num_computed_tokens before this step; the scheduler advances it when it schedules).
The runner samples a token for a request when the step reaches the end of its tokens (`samples`). With
async scheduling a decode row's input token can be one the previous step is still sampling: the runner
sees it as `start == request.num_tokens` (not yet appended) and takes it from that step's device output.
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
    samples: bool = True  # the step reaches the end of the request's tokens: sample one


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
