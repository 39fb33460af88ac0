"""A snapshot of the engine's counters, read by the server's /metrics (host only, no jax)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
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
    # cumulative seconds of the step thread's host work, by phase (STEP_HOST_PHASES)
    step_host_s: dict[str, float] = field(default_factory=dict)


# The step thread's host phases: building the batch (scheduler), building its inputs and enqueueing the
# model and sampler on the device (runner.dispatch), and reading the tokens back (after the wait) and
# turning them into request outputs (scheduler update, stop checks, detokenizing).
STEP_HOST_PHASES = ("schedule", "dispatch", "process")
