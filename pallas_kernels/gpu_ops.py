"""Public GPU ops of pallas_kernels, the names the attention layer calls.

ragged_paged_attention: the Pallas kernel (ragged_paged_attention_gpu.py).
write_kv_cache: XLA's scatter under donation (kv_cache_write.py) or the Pallas kernel
(kv_cache_write_gpu.py); both update the donated cache in place. The scatter is the default until the
kernel measures better on the H200 (benchmarks/kernels.py, "kv_write" rows).
"""

from __future__ import annotations

from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.kv_cache_write_gpu import write_kv_cache_pallas
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention

__all__ = ["ragged_paged_attention", "write_kv_cache", "write_kv_cache_pallas"]
