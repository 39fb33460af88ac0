"""KV-cache write as a Pallas kernel (Triton lowering): the step's new K/V rows go into their slots.

Grid (Hkv, cdiv(T, block_t)). Program (h, i) loads block_t rows of head h of k and v and stores each
row to slot_mapping[row] of the head's pages, viewed as [P * PS, D]. k and v may be wider than the cache
(`k_head`, `v_head`: cache head h takes k[:, k_head + h] and v[:, v_head + h]), so one fused q|k|v array
[T, Hq + 2 Hkv, D] serves as both, read in place: no kernel has to cut k and v out of it first. The page
arrays are aliased input -> output (input_output_aliases), so under jit with the cache donated nothing but the written
rows is touched: no copy of the pool. Rows with slot < 0 (padding) are masked out of the store.

FP8 pages (kv_quant.py): each program divides its rows by the layer's k_scale / v_scale, saturates and
casts them to the page dtype in registers before the store, so a bf16 q|k|v array is read once, as it is,
and never copied into an fp8 one first. Other page dtypes get the rows cast to theirs (by XLA, before the
launch, a no-op when the dtypes agree).

ops.write_kv_cache is this kernel: it beats XLA's in-place scatter (kv_write_xla.py) at large row
counts (benchmarks/kernels.py, "kv_write" rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.kv_quant import is_fp8, quantize_kv, scales_array


def _write_kernel(
    slot_ref,  # i32[Tp]
    k_ref,  # [Tp, D] (head squeezed)
    v_ref,  # [Tp, D]
    *refs,  # fp8 pages: scale_ref f32[2] (k_scale, v_scale) first; then the pages below
    # kp_in_ref, vp_in_ref  [N + 1, D] aliased with kp_ref, vp_ref; unread
    # kp_ref, vp_ref        [N + 1, D]  N = P * PS; row N is a scratch row in interpret mode only
    block_t: int,
    num_slots: int,
    quantized: bool,
):
    scale_ref = refs[0] if quantized else None
    _, _, kp_ref, vp_ref = refs[1:] if quantized else refs
    i = pl.program_id(1)
    rows = pl.ds(i * block_t, block_t)
    slots = slot_ref[rows]
    valid = slots >= 0
    # Masked rows still need an in-range address; num_slots is the scratch row (interpret mode).
    dst = jnp.where(valid, slots, num_slots)
    cols = jnp.arange(kp_ref.shape[1], dtype=jnp.int32)
    idx = (dst[:, None], cols[None, :])  # a pure gather index: lowers on Triton and in interpret mode
    k, v = k_ref[rows, :], v_ref[rows, :]
    if quantized:
        k = quantize_kv(k, scale_ref[0], kp_ref.dtype)
        v = quantize_kv(v, scale_ref[1], vp_ref.dtype)
    plgpu.store(kp_ref.at[idx], k, mask=valid[:, None])
    plgpu.store(vp_ref.at[idx], v, mask=valid[:, None])


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
    k_scale=1.0,  # float or f32[]: fp8 pages store k / k_scale (kv_quant.py); unused for other dtypes
    v_scale=1.0,
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
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must have one dtype")
    quantized = is_fp8(k_pages.dtype)
    _, p, ps, _ = k_pages.shape
    n = p * ps
    block_t = row_block(t, block_t)
    tp = -(-t // block_t) * block_t
    slots = slot_mapping
    if not quantized:
        k, v = k.astype(k_pages.dtype), v.astype(v_pages.dtype)
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
    in_specs = [pl.BlockSpec((tp,), lambda h, i: (0,)), k_spec, v_spec]
    args = [slots, k, v]
    if quantized:
        in_specs.append(pl.BlockSpec((2,), lambda h, i: (0,)))
        args.append(scales_array(k_scale, v_scale))
    first_page = len(args)
    kf, vf = pl.pallas_call(
        functools.partial(_write_kernel, block_t=block_t, num_slots=n if extra else 0, quantized=quantized),
        grid=(hkv, tp // block_t),
        in_specs=[*in_specs, page_spec, page_spec],
        out_specs=[page_spec, page_spec],
        out_shape=[jax.ShapeDtypeStruct(kf.shape, kf.dtype), jax.ShapeDtypeStruct(vf.shape, vf.dtype)],
        input_output_aliases={first_page: 0, first_page + 1: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        name="write_kv_cache_fp8" if quantized else "write_kv_cache",
    )(*args, kf, vf)
    return kf[:, :n].reshape(k_pages.shape), vf[:, :n].reshape(v_pages.shape)
