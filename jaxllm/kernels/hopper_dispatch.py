"""Ragged paged attention on Hopper: each row of the batch goes to the kernel that is fastest for it.

Decode-like batches (at most two rows per sequence) with enough work for the persistent Mosaic decode
kernel (mosaic_decode.py: at least DECODE_MIN_UNITS (row, KV head) units) run there
(`_decode_like`):
  - T == S (the engine's decode buckets): every row, chunk rows included, on that kernel; one launch.
  - S < T <= 2 S: the decode rows on that kernel, then the short chunks and the padding rows on the
    Triton kernel's decode-like config, written into the same output in place.
On the H200 that kernel reads the KV cache at 3.7-4.1 TB/s at batch 256-1000 where the Triton kernel
reaches 3.2-3.4 (benchmarks/decode_mgpu.py, results/2026-12-03-h200-decode-mgpu.json). Smaller batches
stay on the Triton kernel, whose context splits keep more SMs busy.

Other batches (one output buffer, written by up to three launches in turn):
  1. Where contexts can reach PREFILL_MIN_CONTEXT tokens, prefill chunks of at least `mosaic_min_q_len`
     query rows (one TILE, 128, by default) go to the Mosaic GPU prefill kernel (mosaic_prefill.py; wgmma, per-page TMA, warp-specialised:
     461 / 543 TFLOP/s at 4 x 2048 / 1 x 8192 causal on the H200 against the Triton kernel's 214 / 252).
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

What neither Mosaic kernel covers runs on ragged_paged_attention_gpu as a whole: shorter block tables
(step 1 skipped), a logit soft cap or sliding window, float32, page sizes below 8 or not dividing the
kernels' KV blocks.

Measured on the H200 (2026-12-03, Llama-3.1-8B shape, offline 1000 x 512 -> 256 with 2048-token steps,
before the decode kernel): 8,777 output tok/s against 8,804 for the Triton kernel alone, the same
within noise: the prefill attention is 4 ms of a 50 ms step whose matmuls take 39 ms. The prefill
kernel matters for long prompts, where prefill attention grows with the square of the length.

Shapes (dimension letters as in jaxllm/kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; kv_lens i32[S]; block_tables i32[S, B]; cu_q_lens i32[S + 1]; num_seqs i32[1].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels.mosaic_decode import DecodeMgpuConfig, decode_launch, decode_rows, group_rows
from jaxllm.kernels.mosaic_prefill import prefill_paged_attention_mgpu
from jaxllm.kernels.mosaic_schedule import default_config as mgpu_default_config
from jaxllm.kernels.triton_attention import (
    decode_like,
    from_launch_layout,
    launch_rows,
    query_view,
    ragged_paged_attention,
    resolve_config,
    to_launch_layout,
    validate_args,
)

# Decode-like batches take the persistent Mosaic decode kernel for their decode rows when they have at
# least DECODE_MIN_UNITS (row, KV head) units. Below that the Triton kernel's context splits keep more SMs
# busy: inside a Llama-3.1-8B step on the H200 (benchmarks/step_profile.py) its batch-1 attention took
# 9.7 us per layer, and serving at concurrency 1 lost 0.23 ms per token with the Mosaic kernel there
# (results/2026-12-04-h200-serve-llama8b-mgpu-decode-sweep.json); at batch 32 the Mosaic kernel took 25.7
# us per layer against 32.5.
DECODE_MIN_UNITS = 256


# The Mosaic prefill kernel takes part only where a context can reach PREFILL_MIN_CONTEXT tokens (block-
# table width x page size, i.e. max_model_len). Its lead grows with the context (2.2x the Triton kernel
# at 4 x 2048 causal, H200), but at the Llama-3.1-8B shape prefill attention is 3% of a 2048-token
# prompt's FLOPs (13% at 8192), and 512-token prompts ran no faster end to end (8,777 vs 8,804 output
# tok/s). Each step variant that holds it costs about 0.7 s more to trace and lower, with a warm
# compilation cache too (0.8 s against 0.12 for the Triton kernel; results/2026-12-04-h200-op-load.log).
PREFILL_MIN_CONTEXT = 8192


def mosaic_covers(
    t: int,
    s: int,
    b: int,
    dtype,
    page_size: int,
    head_dim: int,
    *,
    soft_cap,
    sliding_window,
    min_context: int,
) -> bool:
    """Whether the Mosaic prefill kernel takes part for these static shapes (b: block-table width in pages)
    and options."""
    if soft_cap is not None or sliding_window is not None or decode_like(t, s):
        return False
    if b * page_size < min_context:
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return page_size >= 8 and mgpu_default_config(head_dim).block_kv % page_size == 0


def decode_mosaic_covers(
    t: int, s: int, hq: int, hkv: int, dtype, page_size: int, *, soft_cap, sliding_window, min_units: int
) -> bool:
    """Whether the Mosaic decode kernel takes the decode rows of this decode-like batch (static shapes)."""
    if soft_cap is not None or sliding_window is not None or not decode_like(t, s):
        return False
    if t * hkv < min_units:
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
    prefill_min_context: int = PREFILL_MIN_CONTEXT,
    decode_min_units: int = DECODE_MIN_UNITS,
    interpret: bool = False,
    q_heads: int | None = None,
):
    """Same contract and result as ref_ragged_paged_attention; decode batches and (with long block tables)
    long prefill chunks on the Mosaic GPU kernels (sm_90), everything else on the Triton-lowered kernel
    (module docstring). prefill_min_context and decode_min_units move the static rules (tests set them
    to route small problems to the Mosaic kernels). q_heads: as in ragged_paged_attention (a fused q|k|v).

    Compiled as one jitted computation on the GPU. In interpret mode the parts run one by one instead:
    Mosaic GPU's interpreter runs the kernel's threads as host callbacks, which wait forever when the
    XLA CPU computation calling them also holds the interpreted Triton launches."""
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    kw.update(
        mosaic_min_q_len=mosaic_min_q_len, prefill_min_context=prefill_min_context, decode_min_units=decode_min_units,
        q_heads=q_heads,
    )  # fmt: skip
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    if interpret:
        return _hopper(*args, interpret=True, **kw)
    return _hopper_jit(*args, interpret=False, **kw)


def _hopper(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
    *, sm_scale, soft_cap, sliding_window, mosaic_min_q_len, prefill_min_context, decode_min_units, interpret,
    q_heads,
):  # fmt: skip
    validate_args(
        query_view(q, q_heads), k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window,
        soft_cap,
    )  # fmt: skip
    if mosaic_min_q_len < 2:
        raise ValueError(f"{mosaic_min_q_len=} must be >= 2 (decode rows stay on the Triton kernel)")
    t, _, d = q.shape
    hq = q_heads or q.shape[1]
    hkv, _, ps, _ = k_pages.shape
    s, b = block_tables.shape
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)
    cover = dict(soft_cap=soft_cap, sliding_window=sliding_window, min_units=decode_min_units)
    if decode_mosaic_covers(t, s, hq, hkv, q.dtype, ps, **cover):
        qs = q[:, :hq]  # the query heads (XLA fuses the cut into the padding copy _decode_like makes)
        return _decode_like(qs, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kw)
    prefill_cover = dict(soft_cap=soft_cap, sliding_window=sliding_window, min_context=prefill_min_context)
    if not mosaic_covers(t, s, b, q.dtype, ps, d, **prefill_cover):
        return ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, q_heads=q_heads, **kw
        )

    long_rows = prefill_paged_attention_mgpu(
        q[:, :hq], k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, min_q_len=mosaic_min_q_len, interpret=interpret,
    )  # fmt: skip
    pcfg = resolve_config(t, s, hq, hkv, d, ps, b, k_splits=1)
    dcfg = resolve_config(s, s, hq, hkv, d, ps, b, k_splits=1)
    # The Triton launches work in launch layout; in interpret mode with room past T for its clamped
    # slices (as in ragged_paged_attention).
    extra_rows = max(pcfg["block_q"], dcfg["block_q"]) if interpret else 0
    qg = to_launch_layout(q, hkv, extra_rows, q_heads=q_heads)
    out = to_launch_layout(long_rows, hkv, extra_rows)
    launch = functools.partial(
        launch_rows, qg, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, t=t,
        max_q_len=mosaic_min_q_len, **kw,
    )  # fmt: skip
    out = launch(dcfg, select="decode", num_items=s + 1, prior=out)
    out = launch(pcfg, select="prefill", prior=out)
    return from_launch_layout(out, t, hq)


def _decode_like(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, interpret, **kw):
    """A decode-like batch on the launch layout with query groups padded to whole 8-row tiles (the Mosaic
    kernel's TMA unit).

    With as many rows as sequences (T == S: the engine's decode buckets) every row goes to the Mosaic
    decode kernel, a row of a short chunk included (it reads its context up to its own position), and
    no Triton launch follows: T rows each reading at most the longest context is the cost of a full
    decode batch of that bucket anyway, whereas the Triton launch over an empty set of chunks still took
    4-11 us per layer at batch 32-256 (H200). With more rows than sequences (up to 2 S) a chunk could
    multiply that bound, so only the decode rows go to the Mosaic kernel, and the short chunks and the
    padding rows to the Triton kernel's decode-like config, written into that output in place."""
    t, hq, d = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, b = block_tables.shape
    all_rows = t == s
    cfg = resolve_config(t, s, hq, hkv, d, ps, b, k_splits=1)
    qg = to_launch_layout(q, hkv, cfg["block_q"] if interpret and not all_rows else 0, min_group=8)
    rows = decode_rows(kv_lens, cu_q_lens, num_seqs, qg.shape[0], only_decode=not all_rows)
    mcfg = DecodeMgpuConfig(pv_mode="smem") if interpret else DecodeMgpuConfig()
    if interpret:  # see prefill_paged_attention_mgpu: the interpreter wants ready inputs
        jax.block_until_ready((qg, rows, k_pages, v_pages, block_tables))
    out = decode_launch(
        qg, k_pages, v_pages, rows, block_tables, sm_scale=kw["sm_scale"], config=mcfg, interpret=interpret
    )
    if all_rows:
        return from_launch_layout(out, t, hq)
    out = launch_rows(
        qg, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, cfg, t=t, select="prefill",
        prior=out, interpret=interpret, **kw,
    )  # fmt: skip
    return from_launch_layout(out, t, hq)


_hopper_jit = jax.jit(
    _hopper,
    static_argnames=(
        "sm_scale", "soft_cap", "sliding_window", "mosaic_min_q_len", "prefill_min_context", "decode_min_units",
        "interpret", "q_heads",
    ),
)  # fmt: skip
