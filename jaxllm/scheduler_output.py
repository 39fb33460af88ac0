"""What the scheduler tells the runner for one step: plain data (ints, lists, SamplingParams), no `Request`.

The runner keeps its own state per request (jaxllm/runner/request_state.py) and this message is how it
stays in step with the scheduler's:
  - `new_requests`: requests the runner does not hold, sent whole ONCE: new ones, and ones resumed after
    a preemption (recomputed or swapped back in), with the tokens they already generated and their whole
    block table again;
  - `scheduled`: every request of the step, in row order (decodes first, then prompt chunks), as a delta:
    how many new tokens from which position, the blocks appended since the runner last saw it, and
    whether the step samples a token for it (it reaches the end of the request's known tokens);
  - `finished_request_ids` / `preempted_request_ids`: states the runner drops (before adding the new ones:
    a resumed request comes back as new).
The runner appends the tokens it samples to its own state, as the scheduler appends them to its Requests:
a decode step of N running requests costs O(N) here, whatever their lengths, which is also all that a
multi-host leader publishes to its followers (jaxllm/parallel/follower.py).

With async scheduling a decode row's input token can be one the previous step is still sampling: the
runner sees it as `start == len(its tokens)` (not collected yet) and takes it from that step's device
output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet: all it needs to build its state."""

    req_id: str
    prompt_token_ids: list[int]  # the scheduler's list, shared: neither side changes it
    sampling_params: SamplingParams
    sampling_seed: int  # the k-th generated token is drawn with key(sampling_seed, k)
    eos_token_id: int | None
    block_ids: list[int]  # the whole block table, in order (its own list)
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit, or swapped back in)
    output_token_ids: list[int] = field(default_factory=list)  # generated before a preemption (own copy)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the step."""

    req_id: str
    num_new_tokens: int
    start: int  # the request's num_computed_tokens when scheduled: position of the first new token
    new_block_ids: list[int]  # blocks appended since the runner last saw it ([] for a new request)
    samples: bool = True  # the step reaches the end of the request's tokens: sample one
    # Speculative decoding: proposed tokens, the last ones of the step's num_new_tokens (after the request's
    # last known token); the step samples after each of them too and returns those it accepts plus one.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # row order
    new_requests: list[NewRequestData] = field(default_factory=list)  # each also in `scheduled`
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    # KV swapping between device and host (swap_space > 0): (device block, host block) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the device nor the runner's state (finished ids alone may wait for the next step)."""
        return not (
            self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.preempted_request_ids
        )
