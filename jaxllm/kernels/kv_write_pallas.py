"""KV-cache write as a Pallas kernel (Triton lowering): the step's new K/V rows go into their slots.

Grid (Hkv, cdiv(T, block_t)). Program (h, i) loads block_t rows of head h of k and v and stores each
row to slot_mapping[row] of the head's pages, viewed as [P * PS, D]. k and v may be wider than the cache
(`k_head`, `v_head`: cache head h takes k[:, k_head + h] and v[:, v_head + h]), so one fused q|k|v array
[T, Hq + 2 Hkv, D] serves as both, read in place: no kernel has to cut k and v out of it first. The page
arrays are aliased input -> output (input_output_aliases), so under jit with the cache donated nothing but the written
rows is touched: no copy of the pool. Rows with slot < 0 (padding) are masked out of the store.

ops.write_kv_cache is this kernel: it beats XLA's in-place scatter (kv_write_xla.py) at large row
counts (benchmarks/kernels.py, "kv_write" rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _write_kernel(
    slot_ref,  # i32[Tp]
    k_ref,  # [Tp, D] (head squeezed)
    v_ref,  # [Tp, D]
    kp_in_ref,  # [N + 1, D] aliased with kp_ref; unread
    vp_in_ref,  # [N + 1, D]
    kp_ref,  # [N + 1, D]  N = P * PS; row N is a scratch row in interpret mode only
    vp_ref,  # [N + 1, D]
    *,
    block_t: int,
    num_slots: int,
):
    del kp_in_ref, vp_in_ref
    i = pl.program_id(1)
    rows = pl.ds(i * block_t, block_t)
    slots = slot_ref[rows]
    valid = slots >= 0
    # Masked rows still need an in-range address; num_slots is the scratch row (interpret mode).
    dst = jnp.where(valid, slots, num_slots)
    cols = jnp.arange(kp_ref.shape[1], dtype=jnp.int32)
    idx = (dst[:, None], cols[None, :])  # a pure gather index: lowers on Triton and in interpret mode
    plgpu.store(kp_ref.at[idx], k_ref[rows, :], mask=valid[:, None])
    plgpu.store(vp_ref.at[idx], v_ref[rows, :], mask=valid[:, None])


def row_block(t: int, block_t: int) -> int:
    """Rows per program: the largest power of two <= block_t dividing T when that is >= 8 (the engine's
    token buckets are powers of two from 8: no padded copy of k and v, which costs two extra kernels
    per layer at T = 8), else block_t with the rows padded."""
    b = block_t
    while b >= 8 and t % b:
        b //= 2
    return b if b >= 8 and t % b == 0 else block_t


@functools.partial(
    jax.jit, static_argnames=("block_t", "interpret", "k_head", "v_head"), donate_argnums=(2, 3)
)
def write_kv_cache_pallas(
    k,  # [T, >= k_head + Hkv, D]
    v,  # [T, >= v_head + Hkv, D]
    k_pages,  # [Hkv, P, PS, D] donated
    v_pages,  # [Hkv, P, PS, D] donated
    slot_mapping,  # i32[T], -1 for padding rows
    *,
    block_t: int = 16,
    interpret: bool = False,
    k_head: int = 0,
    v_head: int = 0,
):
    t, _, d = k.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[3] != d:
        raise ValueError(f"k/v [T, Hkv, D] {k.shape} do not match pages [Hkv, P, PS, D] {k_pages.shape}")
    hkv = k_pages.shape[0]
    for name, x, first in (("k", k, k_head), ("v", v, v_head)):
        if x.ndim != 3 or x.shape[0] != t or x.shape[2] != d or not 0 <= first <= x.shape[1] - hkv:
            raise ValueError(
                f"{name} {x.shape} must be [T={t}, H, D={d}] holding the {hkv} cache heads from head {first}"
            )
    if slot_mapping.shape != (t,) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be i32[{t}], got {slot_mapping.dtype}{list(slot_mapping.shape)}")
    _, p, ps, _ = k_pages.shape
    n = p * ps
    block_t = row_block(t, block_t)
    tp = -(-t // block_t) * block_t
    slots, k, v = slot_mapping, k.astype(k_pages.dtype), v.astype(v_pages.dtype)
    if tp != t:
        slots = jnp.pad(slots, (0, tp - t), constant_values=-1)
        k = jnp.pad(k, ((0, tp - t), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, tp - t), (0, 0), (0, 0)))
    # Compiled, masked stores never touch their address, so no scratch row is needed; interpret mode
    # writes masked rows back with their old value, so it gets a scratch row nobody reads.
    extra = 1 if interpret else 0
    kf = k_pages.reshape(hkv, n, d)
    vf = v_pages.reshape(hkv, n, d)
    if extra:
        kf = jnp.pad(kf, ((0, 0), (0, 1), (0, 0)))
        vf = jnp.pad(vf, ((0, 0), (0, 1), (0, 0)))
    page_spec = pl.BlockSpec((None, n + extra, d), lambda h, i: (h, 0, 0))
    k_spec = pl.BlockSpec((tp, None, d), lambda h, i: (0, k_head + h, 0))
    v_spec = pl.BlockSpec((tp, None, d), lambda h, i: (0, v_head + h, 0))
    kf, vf = pl.pallas_call(
        functools.partial(_write_kernel, block_t=block_t, num_slots=n if extra else 0),
        grid=(hkv, tp // block_t),
        in_specs=[pl.BlockSpec((tp,), lambda h, i: (0,)), k_spec, v_spec, page_spec, page_spec],
        out_specs=[page_spec, page_spec],
        out_shape=[jax.ShapeDtypeStruct(kf.shape, kf.dtype), jax.ShapeDtypeStruct(vf.shape, vf.dtype)],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        name="write_kv_cache",
    )(slots, k, v, kf, vf)
    return kf[:, :n].reshape(k_pages.shape), vf[:, :n].reshape(v_pages.shape)
