"""A model runner stand-in for scheduler tests: deterministic tokens and a simulated paged KV cache.

The simulated cache stores the token id that was "computed" into each slot. Every step it performs the
swaps (out first, then in), writes the scheduled tokens through the block table, and checks that the
whole context the step attends to reads back as the request's own tokens. A wrong prefix hit, a block
reused while still in use, or a lost swap shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxllm.request import Request
from jaxllm.runner_output import ModelRunnerOutput
from jaxllm.scheduler_output import SchedulerOutput


def default_token(request: Request, position: int) -> int:
    """The token 'sampled' after `position` tokens: depends only on the request and position."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.request_id))
    return 3 + (seed * 31 + position * 17) % 997


class FakeRunner:
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        token_fn: Callable[[Request, int], int] = default_token,
    ) -> None:
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.host = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.token_fn = token_fn
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self.device[dev])
            self.num_swapped_out += 1
        for dev, host in out.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
            self.num_swapped_in += 1
        bs = self.block_size
        for s in out.scheduled:
            r = s.request
            assert 0 not in s.block_ids, "block 0 is the null block"
            assert len(s.block_ids) * bs >= s.start + s.num_new_tokens
            tokens = r.all_token_ids
            for p in range(s.start, s.start + s.num_new_tokens):
                self.device[s.block_ids[p // bs]][p % bs] = tokens[p]
        for s in out.scheduled:  # after all writes, as attention reads them
            r = s.request
            tokens = r.all_token_ids
            ctx = [self.device[s.block_ids[p // bs]][p % bs] for p in range(s.start + s.num_new_tokens)]
            assert ctx == tokens[: s.start + s.num_new_tokens], f"KV of {r.request_id} is corrupt"
        return ModelRunnerOutput(
            req_ids=[s.request.request_id for s in out.scheduled],
            sampled_token_ids=[
                [self.token_fn(s.request, s.request.num_tokens)] if s.samples else [] for s in out.scheduled
            ],
        )


def expected_tokens(request: Request, n: int, token_fn=default_token) -> list[int]:
    """The n tokens the fake runner generates for a request (each depends on the sequence length)."""
    p = request.num_prompt_tokens
    return [token_fn(request, p + k) for k in range(n)]
