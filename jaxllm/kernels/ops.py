"""Public GPU ops of jaxllm.kernels, the names the attention layer calls.

ragged_paged_attention: the Pallas kernel (triton_attention.py), Triton-lowered.
ragged_paged_attention_hopper: the same contract with decode batches and long prefill chunks on the
Mosaic GPU kernels (hopper_dispatch.py; sm_90 only).
write_kv_cache: the Pallas kernel (kv_write_pallas.py), chosen by measurement on the H200
(benchmarks/kernels.py, "kv_write" rows: 8192 rows of Llama-3.1-8B K/V in 40 us against 141 us for
XLA's scatter; 64 rows equal, both at launch cost). XLA's scatter under donation stays available as
write_kv_cache_xla. Both update the donated cache in place.
"""

from __future__ import annotations

from jaxllm.kernels.hopper_dispatch import ragged_paged_attention_hopper
from jaxllm.kernels.kv_write_pallas import write_kv_cache_pallas
from jaxllm.kernels.kv_write_xla import write_kv_cache as write_kv_cache_xla
from jaxllm.kernels.triton_attention import ragged_paged_attention

write_kv_cache = write_kv_cache_pallas

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_hopper",
    "write_kv_cache",
    "write_kv_cache_pallas",
    "write_kv_cache_xla",
]
