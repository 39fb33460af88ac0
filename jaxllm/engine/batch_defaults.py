"""Scheduler limits the user left unset: vLLM's defaults for the platform and the entry point
(read by `EngineArgs.create_engine_config`, the one place platform defaults are resolved).

vLLM picks `max_num_seqs` / `max_num_batched_tokens` from the device and from who runs the engine:

    device                                  offline LLM(...)      API server
    accelerator with >= 70 GiB, not A100     1024 / 16384          1024 / 8192
    any other accelerator                    256 / 8192            256 / 2048

A vLLM user who runs `LLM(...)` on a large GPU without these flags gets large batches; so do they here. On the
host (CPU) every compiled bucket costs seconds and memory is the CPU's, so the limits stay small there.
"""

from __future__ import annotations

import os

from jaxllm.config import USAGES

_GIB = 2**30
_LARGE_DEVICE_BYTES = 70 * _GIB
_LARGE = {"offline": (1024, 16384), "server": (1024, 8192)}
_OTHER = {"offline": (256, 8192), "server": (256, 2048)}
HOST_LIMITS = (64, 512)


def default_batch_limits(
    usage: str, platform: str, device_memory_bytes: int | None, device_kind: str = ""
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for `usage` ("offline" or "server") on `platform`
    ("cpu", "gpu", ...) whose first device has `device_memory_bytes` in all (None: not known)."""
    if usage not in USAGES:
        raise ValueError(f"usage={usage!r} must be one of {USAGES}")
    if platform == "cpu":
        return HOST_LIMITS
    large = (device_memory_bytes or 0) >= _LARGE_DEVICE_BYTES and "a100" not in device_kind.lower()
    return (_LARGE if large else _OTHER)[usage]


def device_total_memory(memory_stats: dict | None) -> int | None:
    """The device's whole memory from XLA's pool limit. The pool is a fraction of it
    (XLA_PYTHON_CLIENT_MEM_FRACTION, which the entry points set; JAX's own default is 0.75)."""
    if not memory_stats or "bytes_limit" not in memory_stats:
        return None
    try:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        fraction = 0.75
    if not 0.0 < fraction <= 1.0:
        fraction = 0.75
    return int(memory_stats["bytes_limit"] / fraction)
