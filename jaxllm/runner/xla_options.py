"""XLA compiler options of the model step, per token bucket, chosen by measurement on the H200.

XLA's DotMerger joins dots that share an operand into one dot over the concatenated weights, for dots
whose operand and result bytes are under `xla_gpu_dot_merger_threshold_mb` (32 by default): in a Llama
layer q, k and v merge, gate and up (117 MB each at Llama-3.1-8B) do not.
  - Few tokens (the decode steps of 1-64 sequences): the merged gate|up dot is one Triton GEMM that
    reads both weights in place (the concatenation fuses into it). Threshold 256 MB on the H200,
    Llama-3.1-8B, 640-token contexts, a decode step's device time: b1 4.72 -> 4.60 ms, b32 6.01 ->
    5.68 ms, b64 7.17 -> 6.88 ms.
  - More tokens: the merged dot is slower (b128 8.96 -> 9.28 ms) or goes to cuBLAS, which cannot fuse
    the concatenation, so every step copies gate|up (235 MB per layer) first: b256 14.13 -> 15.60 ms,
    b1000 49.75 -> 53.98 ms. Those buckets keep the default.
    (No merging at all, threshold 0, was no better anywhere: b1 4.90 ms, b1000 49.85 ms.)
benchmarks/results/2026-12-03-h200-step-profile-llama8b-dot-merger-*.json.
"""

from __future__ import annotations

SMALL_STEP_TOKENS = 64  # token buckets up to this one get SMALL_STEP_OPTIONS
SMALL_STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 256}


def is_small_step(num_tokens: int) -> bool:
    """Whether a `num_tokens` bucket compiles with SMALL_STEP_OPTIONS."""
    return num_tokens <= SMALL_STEP_TOKENS


def model_step_options(num_tokens: int) -> dict:
    """Compiler options of the model step of a `num_tokens` bucket ({} = XLA's defaults)."""
    return dict(SMALL_STEP_OPTIONS) if is_small_step(num_tokens) else {}
