"""KV-cache write: scatter the step's new K/V rows into their slots of the paged cache, in place.

slot = page * page_size + offset; a negative slot marks a padding row, which writes nothing. Under jit
with the cache donated, XLA performs the scatter in place (no copy of the pool). Pages of an fp8 dtype
get k / k_scale and v / v_scale, saturated to the format's range (kv_quant.quantize_kv); other pages
the values cast to their dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.kv_quant import quantize_kv


def ref_write_kv_cache(
    k,  # [T, Hkv, D] new keys
    v,  # [T, Hkv, D] new values
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    slot_mapping,  # i32[T], -1 for padding rows
    k_scale=1.0,  # float or f32[]: fp8 pages store k / k_scale (kv_quant.py)
    v_scale=1.0,
):
    hkv, p, ps, d = k_pages.shape
    n = p * ps
    slots = jnp.where(slot_mapping < 0, n, slot_mapping)  # out of range: dropped

    def put(pages, new, scale):
        flat = pages.reshape(hkv, n, d)
        flat = flat.at[:, slots].set(quantize_kv(jnp.swapaxes(new, 0, 1), scale, pages.dtype), mode="drop")
        return flat.reshape(hkv, p, ps, d)

    return put(k_pages, k, k_scale), put(v_pages, v, v_scale)


write_kv_cache = jax.jit(ref_write_kv_cache, donate_argnums=(2, 3))
