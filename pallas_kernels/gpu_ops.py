"""Public GPU ops of pallas_kernels, the names the attention layer calls.

ragged_paged_attention: the Pallas kernel (ragged_paged_attention_gpu.py), Triton-lowered.
ragged_paged_attention_hopper: the same contract with decode batches and long prefill chunks on the
Mosaic GPU kernels (ragged_paged_attention_hopper.py; sm_90 only).
write_kv_cache: the Pallas kernel (kv_cache_write_gpu.py), chosen by measurement on the H200
(benchmarks/kernels.py, "kv_write" rows: 8192 rows of Llama-3.1-8B K/V in 40 us against 141 us for
XLA's scatter; 64 rows equal, both at launch cost). XLA's scatter under donation stays available as
write_kv_cache_xla. Both update the donated cache in place.
"""

from __future__ import annotations

from pallas_kernels.kv_cache_write import write_kv_cache as write_kv_cache_xla
from pallas_kernels.kv_cache_write_gpu import write_kv_cache_pallas
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_hopper import ragged_paged_attention_hopper

write_kv_cache = write_kv_cache_pallas

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_hopper",
    "write_kv_cache",
    "write_kv_cache_pallas",
    "write_kv_cache_xla",
]
