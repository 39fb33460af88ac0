"""Ragged paged attention on Hopper: each row of the batch goes to the kernel that is fastest for it.

Data flow of one call (one output buffer, written by up to three launches in turn):
  1. Prefill chunks of at least `mosaic_min_q_len` query rows (one TILE, 128, by default) go to the
     Mosaic GPU kernel (ragged_paged_attention_mgpu.py; wgmma, per-page TMA, warp-specialised: 461 /
     543 TFLOP/s at 4 x 2048 / 1 x 8192 causal on the H200 against the Triton kernel's 214 / 252).
     Every other row comes out zero. Only long chunks are taken because that kernel works on whole
     128-row tiles of one sequence gathered into a padded copy of q: a short chunk would cost a whole
     tile of gather and tensor work, and with at most T / 128 such chunks the padded copy stays within
     2 T rows (rpa_mgpu_schedule.max_padded_items).
  2. Decode rows (sequences of one query row) run through the Triton kernel's decode configuration,
     written into that output in place (`input_output_aliases`).
  3. Short chunks (2 .. mosaic_min_q_len - 1 rows) and the padding rows run through the Triton kernel's
     prefill configuration, in place again.
Steps 2 and 3 are the two launches of ragged_paged_attention_gpu's split_decode path, each told to
leave the long chunks alone.

Batches the Mosaic kernel does not cover fall back to ragged_paged_attention_gpu as a whole: decode-like
batches (at most two rows per sequence: nothing to gain), a logit soft cap or sliding window, float32,
page sizes below 8 or not dividing its 128-token KV blocks (64 at head_dim 256).

Measured on the H200 (2026-12-03, Llama-3.1-8B shape, offline 1000 x 512 -> 256 with 2048-token steps):
8,777 output tok/s against 8,804 for the Triton kernel alone, the same within noise. In those steps the
prefill attention is 4 ms of 50 (the matmuls take 39 ms at the card's matmul rate), and 512-token
chunks are where the Mosaic kernel's lead is smallest. So the engine's "auto" stays on the Triton
kernel; this path is for long prompts, where prefill attention grows with the square of the length.

Shapes (dimension letters as in pallas_kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; kv_lens i32[S]; block_tables i32[S, B]; cu_q_lens i32[S + 1]; num_seqs i32[1].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention_mgpu import DecodeMgpuConfig, decode_launch, decode_rows, group_rows
from pallas_kernels.ragged_paged_attention_gpu import (
    decode_like,
    from_launch_layout,
    launch_rows,
    ragged_paged_attention,
    resolve_config,
    to_launch_layout,
    validate_args,
)
from pallas_kernels.ragged_paged_attention_mgpu import prefill_paged_attention_mgpu
from pallas_kernels.rpa_mgpu_schedule import default_config as mgpu_default_config

# Decode-like batches take the persistent Mosaic decode kernel for their decode rows when they have at
# least DECODE_MIN_UNITS (row, KV head) units, or when no context can pass DECODE_SHORT_CONTEXT tokens
# (block-table width x page size). Otherwise the Triton kernel's context splits keep more SMs busy: at
# batch 8 and context 8192 it is 1.18x faster, at batch 8 or 1 and context 640 1.40x / 1.15x slower
# (one H200; benchmarks/results/2026-12-03-h200-decode-mgpu.json).
DECODE_MIN_UNITS = 256
DECODE_SHORT_CONTEXT = 2048


def mosaic_covers(t: int, s: int, dtype, page_size: int, head_dim: int, *, soft_cap, sliding_window) -> bool:
    """Whether the Mosaic prefill kernel takes part for these static shapes and options."""
    if soft_cap is not None or sliding_window is not None or decode_like(t, s):
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return page_size >= 8 and mgpu_default_config(head_dim).block_kv % page_size == 0


def decode_mosaic_covers(
    t: int,
    s: int,
    b: int,
    hq: int,
    hkv: int,
    dtype,
    page_size: int,
    *,
    soft_cap,
    sliding_window,
    min_units: int,
) -> bool:
    """Whether the Mosaic decode kernel takes the decode rows of this decode-like batch (static shapes;
    b: block-table width in pages)."""
    if soft_cap is not None or sliding_window is not None or not decode_like(t, s):
        return False
    if t * hkv < min_units and b * page_size > DECODE_SHORT_CONTEXT:
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return page_size >= 8 and DecodeMgpuConfig().block_kv % page_size == 0 and group_rows(hq, hkv) <= 64


def ragged_paged_attention_hopper(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    kv_lens,  # i32[S]
    block_tables,  # i32[S, B]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    mosaic_min_q_len: int = 128,
    decode_min_units: int = DECODE_MIN_UNITS,
    interpret: bool = False,
):
    """Same contract and result as ref_ragged_paged_attention; long prefill chunks on the Mosaic GPU
    kernel (sm_90), everything else on the Triton-lowered kernel (module docstring).

    Compiled as one jitted computation on the GPU. In interpret mode the parts run one by one instead:
    Mosaic GPU's interpreter runs the kernel's threads as host callbacks, which wait forever when the
    XLA CPU computation calling them also holds the interpreted Triton launches."""
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    kw.update(mosaic_min_q_len=mosaic_min_q_len, decode_min_units=decode_min_units)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    if interpret:
        return _hopper(*args, interpret=True, **kw)
    return _hopper_jit(*args, interpret=False, **kw)


def _hopper(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
    *, sm_scale, soft_cap, sliding_window, mosaic_min_q_len, decode_min_units, interpret,
):  # fmt: skip
    validate_args(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window, soft_cap)
    if mosaic_min_q_len < 2:
        raise ValueError(f"{mosaic_min_q_len=} must be >= 2 (decode rows stay on the Triton kernel)")
    t, hq, d = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, b = block_tables.shape
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)
    cover = dict(soft_cap=soft_cap, sliding_window=sliding_window, min_units=decode_min_units)
    if decode_mosaic_covers(t, s, b, hq, hkv, q.dtype, ps, **cover):
        return _decode_like(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kw)
    if not mosaic_covers(t, s, q.dtype, ps, d, soft_cap=soft_cap, sliding_window=sliding_window):
        return ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kw)

    long_rows = prefill_paged_attention_mgpu(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, min_q_len=mosaic_min_q_len, interpret=interpret,
    )  # fmt: skip
    pcfg = resolve_config(t, s, hq, hkv, d, ps, b, k_splits=1)
    dcfg = resolve_config(s, s, hq, hkv, d, ps, b, k_splits=1)
    # The Triton launches work in launch layout; in interpret mode with room past T for its clamped
    # slices (as in ragged_paged_attention).
    extra_rows = max(pcfg["block_q"], dcfg["block_q"]) if interpret else 0
    qg = to_launch_layout(q, hkv, extra_rows)
    out = to_launch_layout(long_rows, hkv, extra_rows)
    launch = functools.partial(
        launch_rows, qg, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, t=t,
        max_q_len=mosaic_min_q_len, **kw,
    )  # fmt: skip
    out = launch(dcfg, select="decode", num_items=s + 1, prior=out)
    out = launch(pcfg, select="prefill", prior=out)
    return from_launch_layout(out, t, hq)


def _decode_like(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, interpret, **kw):
    """A decode-like batch: its decode rows on the Mosaic decode kernel, then its short chunks and padding
    rows on the Triton kernel's decode-like config, written into that output in place. Both work on the
    launch layout with query groups padded to whole 8-row tiles (the Mosaic kernel's TMA unit)."""
    t, hq, d = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, b = block_tables.shape
    cfg = resolve_config(t, s, hq, hkv, d, ps, b, k_splits=1)
    qg = to_launch_layout(q, hkv, cfg["block_q"] if interpret else 0, min_group=8)
    rows = decode_rows(kv_lens, cu_q_lens, num_seqs, qg.shape[0], only_decode=True)
    mcfg = DecodeMgpuConfig(pv_mode="smem") if interpret else DecodeMgpuConfig()
    if interpret:  # see prefill_paged_attention_mgpu: the interpreter wants ready inputs
        jax.block_until_ready((qg, rows, k_pages, v_pages, block_tables))
    out = decode_launch(
        qg, k_pages, v_pages, rows, block_tables, sm_scale=kw["sm_scale"], config=mcfg, interpret=interpret
    )
    out = launch_rows(
        qg, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, cfg, t=t, select="prefill",
        prior=out, interpret=interpret, **kw,
    )  # fmt: skip
    return from_launch_layout(out, t, hq)


_hopper_jit = jax.jit(
    _hopper,
    static_argnames=(
        "sm_scale", "soft_cap", "sliding_window", "mosaic_min_q_len", "decode_min_units", "interpret"
    ),
)  # fmt: skip
