"""XLA compiler options of the model step, per token bucket, chosen by measurement on the H200.

Three tiers of token buckets, each compiled with its own options (`step_tier`, `tier_options`):

- small (up to SMALL_STEP_TOKENS, the decode steps of 1-64 sequences): XLA's DotMerger joins dots that
  share an operand into one dot over the concatenated weights, for dots whose operand and result bytes
  are under `xla_gpu_dot_merger_threshold_mb` (32 by default: q, k and v merge, gate and up, 117 MB each
  at Llama-3.1-8B, do not). At 256 MB the merged gate|up dot is one Triton GEMM that reads both weights
  in place (the concatenation fuses into it). H200, Llama-3.1-8B, 640-token contexts, a decode step's
  device time: b1 4.72 -> 4.60 ms, b32 6.01 -> 5.68 ms, b64 7.17 -> 6.88 ms.
- default (between the two): XLA's defaults. The merged gate|up dot was slower at b128 (8.96 -> 9.28 ms).
- large (LARGE_STEP_TOKENS and up: decode batches of 256+ and prefill steps): no Triton GEMMs, no dot
  merging. With XLA's defaults these steps ran q|k|v as one Triton GEMM at half the rate cuBLAS reaches
  on the other projections (49 us per layer at b256), and cuBLAS without the merger's veto would copy
  the concatenated q|k|v weights every step (0.8 ms per step). Triton GEMMs off alone: b256 13.30 ->
  12.96 ms, prefill of 32 x 512 tokens 385.2 -> 373.2 ms (its XLA fusions 36.4 -> 21.2 ms), b1000 44.74
  -> 44.54 ms, the concatenation copies included (results/2026-12-04-h200-step-profile-llama8b-triton-
  gemm-*.json). At b32 the same option doubled the step (5.43 -> 9.86 ms: the normalisation fusions
  lost their Triton emitter), hence the tiers.

Earlier: benchmarks/results/2026-12-03-h200-step-profile-llama8b-dot-merger-*.json.
"""

from __future__ import annotations

SMALL_STEP_TOKENS = 64  # token buckets up to this one get SMALL_STEP_OPTIONS
SMALL_STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 256}
LARGE_STEP_TOKENS = 256  # token buckets from this one up get LARGE_STEP_OPTIONS
LARGE_STEP_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
STEP_TIERS = ("small", "default", "large")


def step_tier(num_tokens: int) -> str:
    """Which option tier a `num_tokens` bucket compiles with."""
    if num_tokens <= SMALL_STEP_TOKENS:
        return "small"
    return "large" if num_tokens >= LARGE_STEP_TOKENS else "default"


def tier_options(tier: str) -> dict:
    """Compiler options of a tier ({} = XLA's defaults)."""
    return dict({"small": SMALL_STEP_OPTIONS, "default": {}, "large": LARGE_STEP_OPTIONS}[tier])
