"""Several hosts, one mesh: `jax.distributed.initialize` from the config or the environment.

Settings come from ParallelConfig (coordinator_address, num_processes, process_id), or, where the config
leaves them at their defaults, from JAXLLM_COORDINATOR_ADDRESS, JAXLLM_NUM_PROCESSES, JAXLLM_PROCESS_ID.
It must run before anything else touches a jax backend (LLMEngine calls it first thing).

How the processes cooperate, two ways (every process builds the engine with the same config):
- offline (`LLM.generate`): start the same script with the same inputs on every host. The scheduler is
  deterministic (same requests in the same order -> same SchedulerOutput each step, sampling seeds
  included), so each process feeds the same steps to its own devices and XLA's collectives join them
  into one program over the global mesh.
- serving (`jaxllm serve ... --num-processes N --process-id i`): process 0 serves HTTP, schedules, and
  publishes each step; the other processes replay those steps (jaxllm/parallel/follower.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax

logger = logging.getLogger("jaxllm")


@dataclass(frozen=True, slots=True)
class DistributedSettings:
    coordinator_address: str | None
    num_processes: int
    process_id: int

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})"
            )
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(
                f"num_processes={self.num_processes} needs coordinator_address (host:port of process 0), "
                "from the config or JAXLLM_COORDINATOR_ADDRESS"
            )


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def resolve_distributed(parallel) -> DistributedSettings:
    """Config values win; unset ones (None / 1 / 0) fall back to the JAXLLM_* environment variables."""
    address = parallel.coordinator_address or os.environ.get("JAXLLM_COORDINATOR_ADDRESS") or None
    num = parallel.num_processes if parallel.num_processes != 1 else _env_int("JAXLLM_NUM_PROCESSES", 1)
    pid = parallel.process_id if parallel.process_id != 0 else _env_int("JAXLLM_PROCESS_ID", 0)
    return DistributedSettings(address, num, pid)


def initialize_distributed(parallel) -> DistributedSettings:
    """Join the other processes (no-op for one process or when already joined)."""
    s = resolve_distributed(parallel)
    if s.num_processes == 1 or jax.distributed.is_initialized():
        return s
    # Host (CPU) collectives across processes go through gloo; GPU backends use NCCL and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=s.coordinator_address, num_processes=s.num_processes, process_id=s.process_id
    )
    logger.info(
        "process %d of %d joined %s: %d devices in all, %d local",
        s.process_id, s.num_processes, s.coordinator_address, jax.device_count(), jax.local_device_count(),
    )  # fmt: skip
    return s


def agree_on_min(value: int) -> int:
    """The smallest of every process's `value` (e.g. KV blocks: each host measures its own free memory,
    but all must allocate the same cache); the value itself with one process."""
    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(value))))
