"""Paged attention for a model layer: write this step's K/V into the cache, then attend over it.

`(q, k, v, kv_cache, metadata) -> (out, kv_cache)`. The backend is chosen statically: "reference" runs the
plain-jnp ops of pallas_kernels (any platform; what the CPU uses), "pallas" runs the GPU kernels.
This is the only module of the model that calls into pallas_kernels.
"""

from __future__ import annotations

import jax

from jaxllm.layers.attention_metadata import AttentionMetadata, KVCache
from pallas_kernels.kv_cache_write import ref_write_kv_cache
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: KVCache,  # ([Hkv, P, PS, D], [Hkv, P, PS, D])
    md: AttentionMetadata,
    *,
    sm_scale: float,
    backend: str = "reference",
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[jax.Array, KVCache]:
    k_pages, v_pages = kv_cache
    if backend == "pallas":
        from pallas_kernels import gpu_ops  # imported lazily: only GPU hosts need the kernels compiled

        k_pages, v_pages = gpu_ops.write_kv_cache(k, v, k_pages, v_pages, md.slot_mapping)
        out = gpu_ops.ragged_paged_attention(
            q, k_pages, v_pages, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        )
    else:
        k_pages, v_pages = ref_write_kv_cache(k, v, k_pages, v_pages, md.slot_mapping)
        out = ref_ragged_paged_attention(
            q, k_pages, v_pages, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        )
    return out, (k_pages, v_pages)
