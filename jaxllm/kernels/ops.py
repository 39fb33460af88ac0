"""Public GPU ops of jaxllm.kernels, the names the attention layer calls.

ragged_paged_attention: the Pallas kernel (triton_attention.py), Triton-lowered; any CUDA GPU.
ragged_paged_attention_hopper: the same contract with decode batches and long prefill chunks on the
Mosaic GPU kernels (hopper_dispatch.py; sm_90 only).
Both take (q, k_pages, v_pages, md: PagedAttentionMetadata, *, sm_scale, ...), as the reference does.

write_kv_cache: the Pallas kernel (kv_write_pallas.py): it beats XLA's scatter at prefill row counts and
ties at decode ones, where both cost a launch (benchmarks/kernels.py, "kv_write" rows). XLA's scatter
under donation stays available as write_kv_cache_xla. Both take the step's slot_mapping alone (the one
array of the batch description they read) and update the donated cache in place.
"""

from __future__ import annotations

from jaxllm.kernels.hopper_dispatch import ragged_paged_attention_hopper
from jaxllm.kernels.kv_write_pallas import write_kv_cache_pallas
from jaxllm.kernels.kv_write_xla import write_kv_cache as write_kv_cache_xla
from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.triton_attention import ragged_paged_attention

write_kv_cache = write_kv_cache_pallas

__all__ = [
    "PagedAttentionMetadata",
    "ragged_paged_attention",
    "ragged_paged_attention_hopper",
    "write_kv_cache",
    "write_kv_cache_pallas",
    "write_kv_cache_xla",
]
