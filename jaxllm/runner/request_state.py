"""The runner's own state of each request it runs, kept in step with the scheduler by plain messages.

    SchedulerOutput --RequestStates.update--> drop finished / preempted ids, add NewRequestData,
                                              extend block tables by the deltas -> states in row order
    the step samples a row -> RequestState.num_in_flight += 1 (dispatch)
    its id comes back      -> appended to output_token_ids, num_in_flight -= 1 (collect)

The runner never reads the scheduler's `Request`: this is its copy of what it needs (token ids, block
table, sampling parameters and seed), built once from NewRequestData and kept by reference across
steps, so a step costs the runner O(scheduled requests), never a copy of whole token lists.

`num_in_flight` counts tokens the runner dispatched but has not collected (async scheduling: up to one
more step is dispatched before the previous one is collected). The k-th generated token is drawn with
key(seed, k) and min_tokens counts outputs, so the row's k is len(output_token_ids) + num_in_flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.runner.sampling_metadata import SamplingRow
from jaxllm.scheduler_output import NewRequestData, SchedulerOutput
from jaxllm.token_ids import slice_tokens


@dataclass(slots=True, eq=False)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]  # shared with the message; never changed
    output_token_ids: list[int]  # the runner's own list: the ids it collected
    block_ids: list[int]  # the whole block table, extended by each step's delta
    # i32[capacity]: block_ids mirrored in numpy (the first len(block_ids) entries), what a step copies
    # into its block tables; capacity doubles as the table grows.
    block_array: np.ndarray
    sampling: SamplingRow  # the sampler's view (holds the two token lists by reference)
    num_in_flight: int = 0  # sampled by a dispatched step, not collected yet

    @classmethod
    def from_new(cls, new: NewRequestData, make_constraint=None) -> RequestState:
        """`make_constraint(params) -> TokenConstraint | None` builds the request's token rules (its grammar
        matcher starts fresh and catches up with tokens generated before a preemption at its first step)."""
        prompt, output = new.prompt_token_ids, list(new.output_token_ids)
        constraint = make_constraint(new.sampling_params) if make_constraint is not None else None
        row = SamplingRow(
            new.sampling_params, new.sampling_seed, prompt, output, new.eos_token_id, constraint
        )
        blocks = list(new.block_ids)
        array = np.zeros(max(16, 1 << max(0, len(blocks) - 1).bit_length()), np.int32)
        array[: len(blocks)] = blocks
        return cls(new.req_id, prompt, output, blocks, array, row)

    def append_blocks(self, block_ids: list[int]) -> None:
        old = len(self.block_ids)
        self.block_ids.extend(block_ids)
        new = len(self.block_ids)
        if new > len(self.block_array):
            grown = np.zeros(max(new, 2 * len(self.block_array)), np.int32)
            grown[:old] = self.block_array[:old]
            self.block_array = grown
        self.block_array[old:new] = block_ids

    @property
    def params(self):
        return self.sampling.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host (prompt + collected outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        return slice_tokens(self.prompt_token_ids, self.output_token_ids, start, stop)


class RequestStates:
    """Every request the runner holds, by id."""

    def __init__(self, make_constraint=None) -> None:
        self.by_id: dict[str, RequestState] = {}
        self.make_constraint = make_constraint  # params -> TokenConstraint | None (ModelRunner's)
        # How many held requests ask for prompt logprobs: a step checks its rows for them only when some do.
        self.num_with_prompt_logprobs = 0
        # Likewise for research (captures, interventions: runner/research_batch.py).
        self.num_with_research = 0

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.by_id

    def __getitem__(self, req_id: str) -> RequestState:
        return self.by_id[req_id]

    def update(self, sched: SchedulerOutput) -> list[RequestState]:
        """Apply one step's message; returns the scheduled requests' states in row order."""
        by_id = self.by_id
        # Dropped before the new ones are added: a request resumed after a preemption comes back as new.
        for rid in sched.finished_request_ids:
            self._drop(rid)
        for rid in sched.preempted_request_ids:
            self._drop(rid)
        for new in sched.new_requests:
            self._drop(new.req_id)
            state = by_id[new.req_id] = RequestState.from_new(new, self.make_constraint)
            if state.params.prompt_logprobs is not None:
                self.num_with_prompt_logprobs += 1
            if state.params.research is not None:
                self.num_with_research += 1
        states = []
        for sr in sched.scheduled:
            state = by_id.get(sr.req_id)
            if state is None:
                raise ValueError(f"request {sr.req_id!r} is scheduled but the runner was never sent it")
            if sr.new_block_ids:
                state.append_blocks(sr.new_block_ids)
            states.append(state)
        return states

    def _drop(self, req_id: str) -> None:
        state = self.by_id.pop(req_id, None)
        if state is None:
            return
        if state.params.prompt_logprobs is not None:
            self.num_with_prompt_logprobs -= 1
        if state.params.research is not None:
            self.num_with_research -= 1
