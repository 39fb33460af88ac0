"""XLA compiler options of the model step, per token bucket.

No one set of XLA options is best for every step: a decode step of a few sequences is bound by reading
the weights, a step of hundreds of tokens by the matmuls' rate, and XLA's GEMM choices that help one
hurt the other. So the token buckets fall into three tiers, each compiled with its own options
(`step_tier`, `tier_options`):

- small (up to SMALL_STEP_TOKENS, the decode steps of 1-64 sequences): XLA's DotMerger joins dots that
  share an operand into one dot over the concatenated weights, but only for dots whose operand and result
  bytes are under `xla_gpu_dot_merger_threshold_mb` (32 by default: at Llama-3.1-8B gate and up, 117 MB
  each, stay apart). Raised to 256 MB, the merged gate|up dot becomes one Triton GEMM that reads both
  weights in place (the concatenation fuses into it): one pass over the MLP's input weights instead of
  two, which is what a weight-bound step needs.
- default (between the two): XLA's defaults. There the merged gate|up dot is slower than two GEMMs.
- large (LARGE_STEP_TOKENS and up: decode batches of 256+ and prefill steps): no Triton GEMMs and no dot
  merging. With XLA's defaults these steps run the q|k|v projection as one Triton GEMM at about half the
  rate cuBLAS reaches on the other projections, and cuBLAS under the merger would copy the concatenated
  weights every step. Turning Triton GEMMs off for the small tier instead doubles its step: its
  normalisation fusions lose their Triton emitter. Hence the tiers.

The measurements behind the thresholds are in docs/performance.md (benchmarks/step_profile.py with
XLA_FLAGS set per run reproduces them).
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
