"""A model runner stand-in for scheduler tests: deterministic tokens and a simulated paged KV cache.

Like the real runner it sees only the plain SchedulerOutput: it builds each request's state (tokens,
block table) from NewRequestData, extends it with the deltas, appends the tokens it "samples" and drops
finished and preempted requests. With `scheduler` given, it checks every step that its own tokens and
block tables are the scheduler's, so a message that leaves the runner out of step fails at once.

The simulated cache stores the token id that was "computed" into each slot. Every step it performs the
swaps (out first, then in), writes the scheduled tokens through the block table, and checks that the
whole context the step attends to reads back as the request's own tokens. A wrong prefix hit, a block
reused while still in use, or a lost swap shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxllm.request import Request
from jaxllm.runner_output import ModelRunnerOutput
from jaxllm.scheduler_output import SchedulerOutput


def default_token(request_id: str, position: int) -> int:
    """The token 'sampled' after `position` tokens: depends only on the request id and position."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request_id))
    return 3 + (seed * 31 + position * 17) % 997


@dataclass
class FakeState:
    tokens: list[int]  # prompt + generated, as the runner knows them
    block_ids: list[int]


class FakeRunner:
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        token_fn: Callable[[str, int], int] = default_token,
        scheduler=None,
    ) -> None:
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.host = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.token_fn = token_fn
        self.scheduler = scheduler
        self.states: dict[str, FakeState] = {}
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def block_table(self, req_id: str) -> list[int]:
        return list(self.states[req_id].block_ids)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in (*out.finished_request_ids, *out.preempted_request_ids):
            self.states.pop(rid, None)
        for new in out.new_requests:
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.states[new.req_id] = FakeState(tokens, list(new.block_ids))
        states = [self.states[s.req_id] for s in out.scheduled]
        for s, st in zip(out.scheduled, states):
            st.block_ids.extend(s.new_block_ids)
            if self.scheduler is not None:
                request = self.scheduler.requests[s.req_id]
                assert st.block_ids == self.scheduler.kv.get_block_ids(request), s.req_id
                assert st.tokens == request.all_token_ids, s.req_id
                assert s.start == request.num_computed_tokens - s.num_new_tokens, s.req_id
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self.device[dev])
            self.num_swapped_out += 1
        for dev, host in out.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
            self.num_swapped_in += 1
        bs = self.block_size
        for s, st in zip(out.scheduled, states):
            assert 0 not in st.block_ids, "block 0 is the null block"
            assert len(st.block_ids) * bs >= s.start + s.num_new_tokens
            # speculative decoding: the proposals follow the known tokens (their KV is written too)
            inputs = st.tokens + list(s.spec_token_ids)
            assert len(inputs) == s.start + s.num_new_tokens or not s.spec_token_ids, s.req_id
            for p in range(s.start, s.start + s.num_new_tokens):
                self.device[st.block_ids[p // bs]][p % bs] = inputs[p]
        for s, st in zip(out.scheduled, states):  # after all writes, as attention reads them
            end = s.start + s.num_new_tokens
            ctx = [self.device[st.block_ids[p // bs]][p % bs] for p in range(end)]
            assert ctx == (st.tokens + list(s.spec_token_ids))[:end], f"KV of {s.req_id} is corrupt"
        sampled = []
        for s, st in zip(out.scheduled, states):
            if s.samples:
                # the token after each known prefix; a proposal is accepted when it is that token
                new = [self.token_fn(s.req_id, len(st.tokens))]
                for d in s.spec_token_ids:
                    if new[-1] != d:
                        break
                    new.append(self.token_fn(s.req_id, len(st.tokens) + len(new)))
                st.tokens.extend(new)
                sampled.append(new)
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=[s.req_id for s in out.scheduled], sampled_token_ids=sampled)


def expected_tokens(request: Request, n: int, token_fn=default_token) -> list[int]:
    """The n tokens the fake runner generates for a request (each depends on the sequence length)."""
    p = request.num_prompt_tokens
    return [token_fn(request.request_id, p + k) for k in range(n)]
