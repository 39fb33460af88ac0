"""KV-cache write: scatter the step's new K/V rows into their slots of the paged cache, in place.

slot = page * page_size + offset; a negative slot marks a padding row, which writes nothing. Under jit
with the cache donated, XLA performs the scatter in place (no copy of the pool).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ref_write_kv_cache(
    k,  # [T, Hkv, D] new keys
    v,  # [T, Hkv, D] new values
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    slot_mapping,  # i32[T], -1 for padding rows
):
    hkv, p, ps, d = k_pages.shape
    n = p * ps
    slots = jnp.where(slot_mapping < 0, n, slot_mapping)  # out of range: dropped

    def put(pages, new):
        flat = pages.reshape(hkv, n, d)
        flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(hkv, p, ps, d)

    return put(k_pages, k), put(v_pages, v)


write_kv_cache = jax.jit(ref_write_kv_cache, donate_argnums=(2, 3))
