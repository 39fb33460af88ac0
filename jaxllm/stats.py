"""The engine's counters as an immutable snapshot, and the per-step token histogram (host only, no jax).

The engine thread builds a fresh `EngineStats` after each step (`LLMEngine.get_stats`, then
`AsyncLLMEngine` adds the iteration histogram) and publishes it by replacing one reference; the server's
event loop (/metrics, the periodic stats line) reads only that latest snapshot. Every field is an int,
a float, a tuple or a read-only mapping, so nothing the two threads see can change under either.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# The step thread's host phases: building the batch (scheduler), building its inputs and enqueueing the
# model and sampler on the device (runner.dispatch), and reading the tokens back (after the wait) and
# turning them into request outputs (scheduler update, stop checks, detokenizing).
STEP_HOST_PHASES = ("schedule", "dispatch", "process")
# With them, the runner's token-rules thread, beside the step thread: grammars consuming the token in
# flight, masks filled, the sampler enqueued (jaxllm/runner/model_runner.py).
HOST_PHASES = (*STEP_HOST_PHASES, "token_rules")

# Upper bounds (inclusive) of the tokens-per-step histogram's buckets, as vLLM's iteration_tokens_total.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative prompt tokens found there
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative prompt tokens computed
    generation_tokens: int = 0  # cumulative tokens generated
    num_gpu_blocks: int = 0
    block_size: int = 16
    num_compiling_in_background: int = 0  # sampler variants still compiling after ready (start-up only)
    num_steps: int = 0  # cumulative device steps collected
    step_device_wait_s: float = 0.0  # cumulative seconds the step thread waited on the device's results
    # cumulative seconds of host work, by phase (HOST_PHASES); read-only
    step_host_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # Engine steps by tokens scheduled: one count per ITERATION_TOKEN_BUCKETS bound, then one for larger
    # steps (+Inf); not cumulative across buckets. Empty where nobody counts steps (offline LLMEngine).
    iteration_tokens_buckets: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0  # tokens scheduled over all counted steps
    # cumulative counts of the persistent compilation cache (runner/compilation_cache.CacheCounts: hits,
    # misses, stores, corrupt, write_errors); read-only, empty without the cache
    compilation_cache: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # speculative decoding (cumulative, vLLM's names): steps of a request that verified proposals, tokens
    # proposed, tokens accepted, and accepted by position (index j: the (j+1)-th proposal of a step)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


class IterationTokens:
    """Counts steps by tokens scheduled; owned by the thread that steps (not thread-safe by design)."""

    def __init__(self) -> None:
        self._counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._sum = 0

    def observe(self, num_tokens: int) -> None:
        self._counts[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self._sum += num_tokens

    def snapshot(self) -> tuple[tuple[int, ...], int]:
        """(counts per bucket, sum) as immutable values."""
        return tuple(self._counts), self._sum
