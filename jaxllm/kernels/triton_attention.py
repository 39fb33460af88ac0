"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs (Triton lowering): any CUDA GPU, any batch.

Data flow of one call:
  1. q goes to the grouped launch layout [T, Hkv, Gp, D] (ragged_batch.to_launch_layout; a fused q|k|v
     array is only viewed, not copied, where its groups line up).
  2. triton_schedule.build_work_items cuts the flattened batch into work items of <= block_q query rows of
     one sequence (plus zero-context items covering the padding rows).
  3. k_splits == 1: the kernel runs on grid (Hkv, W). Program (h, w) loads the item's q rows for the
     whole query-head group of KV head h as one [block_q * Gp, D] tile, so K/V of a KV head are read
     once per group (GQA/MQA), then streams the context's pages, pages_per_block pages per step,
     gathered through the block table, with an online softmax in float32, normalises and writes the
     output rows.
  4. k_splits > 1 (flash-decoding, for long contexts with few sequences): each (item, split) pair
     streams its share of the item's context. The shares are cut from the item's own key range
     (split_steps), not from the block table's width: the engine's tables are max_model_len / page_size
     wide, and shares of the width would leave all but the first splits idle at short contexts. Each
     writes unnormalised float32 partials with their running max and sum, and a second, small kernel
     (triton_combine.py) merges them.
  5. k_splits is a static maximum; how many splits a launch uses is decided on the device from the
     items that have keys (triton_schedule.active_splits): the engine pads a step to its bucket, and a
     bucket of 8 sequence slots holding one long sequence would otherwise be split as if all 8 were
     there (a quarter of the SMs streaming its context). The grid is (Hkv, N): N program slots a KV
     head, dealt out on the device to the (item with keys, split in use) pairs
     (triton_schedule.deal_programs), the rest exiting at once. A grid of (items x k_splits) would
     start every split of every item, padding items included: 5,632 programs at 8 slots and 64 splits,
     which cost a decode step of one short sequence 5% on an H100 (docs/performance.md, "Long
     contexts"). The merge reads only the splits in use.

Masking: a key is visible when kv_pos < kv_len, kv_pos <= query position (causal with respect to the
sequence's context: query row i of a q_len chunk sits at kv_len - q_len + i) and, with a sliding
window, kv_pos > position - window. Scores are *selected*, never multiplied, and V rows past kv_len are
zeroed, so garbage (NaN) in unused pages or the tail of the last page cannot leak.

FP8 pages (kv_quant.py: stored = k / k_scale in float8): each K/V block is loaded in its 8 bits (half
the bytes of bf16, which is what decode is bound by) and upcast to q's dtype in registers, so both dots
stay bf16/f16 x bf16/f16 with f32 accumulation. The scales never touch the blocks: q k_scale . k8 is
q . (k8 k_scale), so k_scale joins the factor q is multiplied by once per program, and
sum p (v8 v_scale) = v_scale sum p v8, so v_scale multiplies the accumulator once at the end.

Static variants of the loop (knobs of ragged_paged_attention, compared by benchmarks/kernel_sweep.py):
  loop_layout="split": three loops, masked head (sliding window only), unmasked interior, masked tail;
    the interior skips the mask arithmetic. "masked": one loop that masks every step.
  prefetch_pages: each step's page ids travel in the loop carry and the next step's are read during
    the current one. Triton's pipeliner (AssignLatencies) splits num_stages - 1 of latency over the
    chain of dependent loads feeding a dot; with the block-table read in the same step the K/V loads
    sit at indirection level 1 and get one step of latency (one buffer) at num_stages 3 or 4. Carried
    ids leave K/V at level 0: num_stages - 1 buffers in flight (at the default decode tiles, more shared
    memory and one CTA per SM instead of two).
  pages_per_block, num_stages, num_warps set bytes in flight per CTA against CTAs per SM.

Why Triton here: the kernel gathers pages through the block table with vector indices, masks ragged row
ranges, runs under interpret=True for the CPU tests, and Triton's pipeliner overlaps the gathered page
loads. Decode is memory-bound (about one FLOP per byte of KV), so bytes in flight per SM matter more
than the lowering. Prefill chunks are compute-bound, and there this kernel stays well under cuDNN: on
Hopper the dispatcher (hopper_dispatch.py) sends long chunks to the wgmma kernel in mosaic_prefill.py.
Figures: docs/performance.md.

Public API: ragged_paged_attention (the op), and for the dispatcher, which launches this kernel over a
subset of the rows into a shared output: default_config / resolve_config and launch_rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.kv_quant import is_fp8, scales_array
from jaxllm.kernels.metadata import PagedAttentionMetadata, check_inputs
from jaxllm.kernels.ragged_batch import (
    decode_like,
    from_launch_layout,
    next_pow2,
    query_view,
    to_launch_layout,
)
from jaxllm.kernels.triton_combine import MASK_VALUE, combine_splits, live_rows, padded_splits
from jaxllm.kernels.triton_schedule import active_splits, build_work_items, deal_programs

__all__ = ["DTYPES", "KNOBS", "default_config", "launch_rows", "ragged_paged_attention", "resolve_config"]

LOOP_LAYOUTS = ("split", "masked")
_LOOP_DEFAULTS = dict(loop_layout="split", prefetch_pages=False, split_decode=True)
# Programs a split launch aims for (triton_schedule.active_splits): four for each of an H100's or H200's
# 132 SMs. One long sequence then streams its K and V at about 3 TB/s on an H100, where 256 programs
# gave 1.7 (docs/performance.md, "Long contexts"). 0 turns the device-side choice off (every launch uses
# all k_splits), for sweeps.
SPLIT_TARGET = 528
# Splits a decode bucket may have beyond what a full bucket needs, bounded so that k_splits x S (rows of
# the float32 partials' buffer; triton_combine reads only the splits in use) stays at most SPLIT_ROWS.
SPLIT_ROWS = 512
KNOBS = (
    "block_q",
    "pages_per_block",
    "k_splits",
    "num_warps",
    "num_stages",
    "loop_layout",
    "prefetch_pages",
    "split_decode",
    "split_target",
)
_LOG2E = math.log2(math.e)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _rpa_kernel(
    seq_ref,  # i32[W]
    q0_ref,  # i32[W]
    q1_ref,  # i32[W]
    kv_len_ref,  # i32[W]
    pos0_ref,  # i32[W]
    splits_ref,  # i32[1] splits in use (<= k_splits; triton_schedule.active_splits)
    deal_item_ref,  # k_splits > 1: i32[N] work item of program slot n (-1: none); else unused i32[1]
    deal_split_ref,  # k_splits > 1: i32[N] its split; else unused i32[1]
    bt_ref,  # i32[S, Bp]
    q_ref,  # [Tp, Gp, D]  (KV head squeezed)
    k_ref,  # [P, PS, D]  (q's dtype, or fp8)
    v_ref,  # [P, PS, D]
    *refs,  # fp8 pages: scale_ref f32[2] (k_scale, v_scale) first; then:
    # o_ref  [Tp, Gp, D]  (q dtype); k_splits > 1: f32[Kp, Tp, Gp, D], every split's partials
    # k_splits > 1: m_ref, l_ref f32[Kp, Tp, Gp]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_q: int,
    pages_per_block: int,
    k_splits: int,
    loop_layout: str,
    prefetch_pages: bool,
    quantized: bool,
):
    scale_ref = refs[0] if quantized else None
    o_ref, *stat_refs = refs[1:] if quantized else refs
    cdt = q_ref.dtype  # compute dtype of both dots (fp8 pages are upcast to it)
    if k_splits > 1:  # program slots dealt out on the device (triton_schedule.deal_programs)
        slot = pl.program_id(1)
        item, split = deal_item_ref[slot], deal_split_ref[slot]
        w, real = jnp.maximum(item, 0), item >= 0
    else:
        w, split, real = pl.program_id(1), 0, True
    _, gp, d = q_ref.shape
    page_size = k_ref.shape[1]
    bk = pages_per_block * page_size
    m_rows = block_q * gp

    seq = seq_ref[w]
    q0 = q0_ref[w]
    q1 = jnp.where(real, q1_ref[w], q0)  # a slot dealt no item has no rows: it reads and stores nothing
    kv_len = kv_len_ref[w]
    pos0 = pos0_ref[w]

    tok = jnp.arange(block_q, dtype=jnp.int32)
    tok_valid = q0 + tok < q1  # [block_q]
    row_tok = lax.broadcasted_iota(jnp.int32, (block_q, gp), 0).reshape(m_rows)  # row -> token
    row_valid = q0 + row_tok < q1  # [M]
    row_pos = pos0 + row_tok  # [M]

    q = plgpu.load(q_ref.at[pl.ds(q0, block_q), :, :], mask=tok_valid[:, None, None], other=0.0)
    q = q.reshape(m_rows, d)
    # Fold the softmax scale and log2(e) into q once, so scores feed exp2 directly (not under a soft cap,
    # which needs the raw scores), and fp8 pages' k_scale (module docstring).
    q_factor = None if soft_cap is not None else sm_scale * _LOG2E
    if quantized:
        q_factor = scale_ref[0] if q_factor is None else scale_ref[0] * q_factor
    if q_factor is not None:
        q = (q.astype(jnp.float32) * q_factor).astype(cdt)

    # Key range this program must visit: causal limit of its last row, window start of its last row
    # (the earliest key any row may see is the first row's), in key steps of bk; then this split's
    # share of the item's own steps (split_steps), so all k_splits programs of an item have work however
    # wide the block table is.
    n_rows = q1 - q0
    pos_last = pos0 + n_rows - 1
    kv_hi = jnp.minimum(kv_len, pos_last + 1)
    kv_lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    used = splits_ref[0] if k_splits > 1 else 1
    blk_lo, blk_hi = split_steps(kv_lo // bk, (kv_hi + bk - 1) // bk, split, used)
    blk_hi = jnp.where(n_rows > 0, blk_hi, blk_lo)
    # Blocks [mid_lo, mid_hi) are visible to every row of the tile: no mask, no V zeroing.
    full_hi = jnp.minimum(pos0 + 1, kv_len) // bk
    if sliding_window is None:
        mid_lo = blk_lo
    else:
        mid_lo = jnp.clip((pos_last - sliding_window + 1 + bk - 1) // bk, blk_lo, blk_hi)
    mid_hi = jnp.clip(full_hi, mid_lo, blk_hi)

    last_blk = bt_ref.shape[1] // pages_per_block - 1

    def page_ids(kb):
        return bt_ref[seq, pl.ds(kb * pages_per_block, pages_per_block)]  # i32[ppb]

    def body(kb, carry, masked: bool):
        if prefetch_pages:
            # This step's page ids came in the carry; fetch the next step's now. The K/V loads then
            # depend on no load of the same step, so Triton gives them the full num_stages - 1 of
            # latency (more buffers in flight) instead of splitting it with the block-table load.
            acc, m_prev, l_prev, pages = carry
            pages_next = page_ids(jnp.minimum(kb + 1, last_blk))
        else:
            acc, m_prev, l_prev = carry
            pages = page_ids(kb)
        k = k_ref[pages].reshape(bk, d).astype(cdt)  # fp8 pages: upcast in registers
        s = plgpu.dot(q, k, trans_b=True)  # f32[M, BK], in log2 units unless soft-capped
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s * (sm_scale / soft_cap)) * _LOG2E
        v = v_ref[pages].reshape(bk, d).astype(cdt)
        if masked:
            kv_pos = kb * bk + jnp.arange(bk, dtype=jnp.int32)  # [BK]
            in_ctx = kv_pos < kv_len
            mask = row_valid[:, None] & in_ctx[None, :] & (kv_pos[None, :] <= row_pos[:, None])
            if sliding_window is not None:
                mask &= kv_pos[None, :] > row_pos[:, None] - sliding_window
            s = jnp.where(mask, s, MASK_VALUE)
            v = jnp.where(in_ctx[:, None], v, jnp.zeros_like(v))
        m_new = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        l_new = alpha * l_prev + p.sum(axis=-1)
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
        if prefetch_pages:
            return acc, m_new, l_new, pages_next
        return acc, m_new, l_new

    acc0 = jnp.zeros((m_rows, d), jnp.float32)
    m0 = jnp.full((m_rows,), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((m_rows,), jnp.float32)
    carry = (acc0, m0, l0)
    if prefetch_pages:
        carry += (page_ids(jnp.minimum(blk_lo, last_blk)),)
    masked_body = functools.partial(body, masked=True)
    if loop_layout == "masked":
        carry = lax.fori_loop(blk_lo, blk_hi, masked_body, carry)
    else:
        if sliding_window is not None:
            carry = lax.fori_loop(blk_lo, mid_lo, masked_body, carry)
        carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(mid_hi, blk_hi, masked_body, carry)
    acc, m_i, l_i = carry[:3]
    if quantized:
        acc = acc * scale_ref[1]  # v_scale, once (module docstring)

    if not stat_refs:
        out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = o_ref.at[pl.ds(q0, block_q), :, :]
        plgpu.store(out_rows, out.reshape(block_q, gp, d).astype(o_ref.dtype), mask=tok_valid[:, None, None])
    else:
        m_ref, l_ref = stat_refs
        stored = tok_valid & (split < used)  # splits past those in use store nothing (triton_combine)
        plgpu.store(
            o_ref.at[split, pl.ds(q0, block_q), :, :], acc.reshape(block_q, gp, d), mask=stored[:, None, None]
        )
        plgpu.store(m_ref.at[split, pl.ds(q0, block_q), :], m_i.reshape(block_q, gp), mask=stored[:, None])
        plgpu.store(l_ref.at[split, pl.ds(q0, block_q), :], l_i.reshape(block_q, gp), mask=stored[:, None])


def split_steps(lo, hi, split, k_splits):
    """Key steps [lo, hi) of one work item cut into k_splits near-equal runs: run `split` of them.
    Runs are whole steps (pages_per_block pages), so no two splits read the same key; runs past the
    item's steps, and splits at or past k_splits (an int, or an i32 scalar chosen on the device), are
    empty (lo == hi), and their programs write m = MASK_VALUE, l = 0."""
    if isinstance(k_splits, int) and k_splits == 1:
        return lo, hi
    per = (hi - lo + k_splits - 1) // k_splits
    start = jnp.minimum(lo + split * per, hi)
    return start, jnp.minimum(start + per, hi)


def default_config(t: int, s: int, hq: int, hkv: int, d: int, page_size: int, b: int) -> dict:
    """Static tuning from shapes alone: decode-like steps (few rows per sequence) vs prefill chunks."""
    gp = next_pow2(hq // hkv)
    if decode_like(t, s):
        block_q = max(1, 16 // gp)
        pages_per_block = max(1, 128 // page_size) if d <= 128 else max(1, 64 // page_size)
        programs = hkv * s
        k_splits = 1
        if programs < SPLIT_TARGET:
            # What a full bucket needs, or, where the partials stay small, what one sequence needs: the
            # launch picks how many it uses from the sequences it finds (module docstring, 5).
            full = next_pow2(-(-SPLIT_TARGET // programs))
            k_splits = max(full, min(next_pow2(-(-SPLIT_TARGET // hkv)), SPLIT_ROWS // s))
        # From the decode sweep (benchmarks/kernel_sweep.py): one masked loop beats the split interior
        # loop in decode (Triton keeps V of the unmasked loop in registers instead of staging it).
        # Without splits, 32-token steps with the page ids prefetched, 3 stages and 2 warps put about
        # four programs on each SM; with splits, 64-token steps 4 deep.
        stages, warps, prefetch = 3, 4, False
        if k_splits > 1:
            pages_per_block = max(1, 64 // page_size)
            stages = 4
        elif d <= 128:
            pages_per_block = max(1, 32 // page_size)
            warps, prefetch = 2, True
        k_splits = max(1, min(k_splits, -(-b // pages_per_block)))
        return dict(
            block_q=block_q,
            pages_per_block=pages_per_block,
            k_splits=k_splits,
            num_warps=warps,
            num_stages=stages,
            split_target=SPLIT_TARGET,
            **{**_LOOP_DEFAULTS, "loop_layout": "masked", "prefetch_pages": prefetch},
        )
    rows = 128 if d <= 128 else 64
    block_q = max(1, rows // gp)
    # 128-token key steps: more matrix work per step than 64, which prefill chunks can use.
    pages_per_block = max(1, (128 if d <= 128 else 32) // page_size)
    return dict(
        block_q=block_q,
        pages_per_block=pages_per_block,
        k_splits=1,
        num_warps=8,
        num_stages=2,
        split_target=SPLIT_TARGET,
        **_LOOP_DEFAULTS,
    )


def resolve_config(t: int, s: int, hq: int, hkv: int, d: int, page_size: int, b: int, **knobs) -> dict:
    """default_config with the knobs that are not None put over it, checked."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown tuning knobs {sorted(unknown)}; known: {KNOBS}")
    cfg = default_config(t, s, hq, hkv, d, page_size, b)
    cfg.update({k: v for k, v in knobs.items() if v is not None})
    cfg["prefetch_pages"] = bool(cfg["prefetch_pages"])
    cfg["split_decode"] = bool(cfg["split_decode"])
    gp = next_pow2(hq // hkv)
    if cfg["loop_layout"] not in LOOP_LAYOUTS:
        raise ValueError(f"loop_layout={cfg['loop_layout']!r} must be one of {LOOP_LAYOUTS}")
    for name in ("block_q", "pages_per_block"):
        val = cfg[name]
        if val < 1 or val & (val - 1):
            raise ValueError(f"{name}={val} must be a power of two >= 1")
    if cfg["k_splits"] < 1:
        raise ValueError(f"k_splits={cfg['k_splits']} must be >= 1")
    if cfg["split_target"] < 0:
        raise ValueError(f"split_target={cfg['split_target']} must be >= 0 (0: always all k_splits)")
    rows, keys = cfg["block_q"] * gp, cfg["pages_per_block"] * page_size
    if rows < 16 or keys < 16:
        raise ValueError(f"tile rows block_q*group={rows} and pages_per_block*page_size={keys} must be >= 16")
    return cfg


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "q_heads", *KNOBS),
)
def ragged_paged_attention(
    q,  # [T, Hq, D], or [T, >= q_heads, D] with q_heads
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    loop_layout: str | None = None,
    prefetch_pages: bool | None = None,
    split_decode: bool | None = None,
    split_target: int | None = None,
    q_heads: int | None = None,
    k_scale=1.0,
    v_scale=1.0,
):
    """Attention of a ragged batch (decode rows and prefill chunks together) over a paged KV cache.

    Same contract as ref_ragged_paged_attention. Tuning knobs left as None take default_config's
    shape-based choice: block_q query tokens per program (times the padded group size = tile rows),
    pages_per_block pages per inner step, k_splits splits of the context (flash-decoding), Triton's
    num_warps / num_stages, and the loop variants loop_layout / prefetch_pages (module docstring).
    split_target: the programs a split launch aims for, from which it picks how many of the k_splits it
    uses (triton_schedule.active_splits; 0: all of them).
    split_decode (default on): in a batch tuned for prefill tiles, the one-row (decode) sequences run in
    their own launch with the decode config; the knobs given apply to the other rows.
    q_heads: q's first q_heads heads are the queries and more heads follow (a fused q|k|v array, read in
    place where its head groups line up with the launch layout: to_launch_layout).
    k_scale, v_scale (float or f32[]): fp8 pages hold k / k_scale and v / v_scale (kv_quant.py); unused
    for pages of q's dtype.
    """
    check_inputs(
        query_view(q, q_heads), k_pages, v_pages, md, dtypes=DTYPES, sliding_window=sliding_window,
        soft_cap=soft_cap,
    )  # fmt: skip
    t, _, d = q.shape
    hq = q_heads or q.shape[1]
    hkv, _, ps, _ = k_pages.shape
    s, b = md.block_tables.shape
    cfg = resolve_config(
        t, s, hq, hkv, d, ps, b,
        block_q=block_q, pages_per_block=pages_per_block, k_splits=k_splits, num_warps=num_warps,
        num_stages=num_stages, loop_layout=loop_layout, prefetch_pages=prefetch_pages,
        split_decode=split_decode, split_target=split_target,
    )  # fmt: skip
    # A mixed batch (prefill tiles) splits off its decode rows: a one-row sequence in a prefill-sized tile
    # would pay block_q times the matrix work for its context. Decode rows go first, through the decode
    # config, then the other rows write into the same output (aliased), each launch skipping the other's.
    dcfg = None
    if cfg["split_decode"] and cfg["k_splits"] == 1 and not decode_like(t, s):
        dcfg = resolve_config(s, s, hq, hkv, d, ps, b, k_splits=1)

    # Interpret mode clamps out-of-range dynamic slices instead of masking them: give it room.
    extra_rows = max(cfg["block_q"], dcfg["block_q"] if dcfg else 1) if interpret else 0
    qg = to_launch_layout(q, hkv, extra_rows, q_heads=q_heads)
    launch = functools.partial(
        launch_rows, qg, k_pages, v_pages, md, t=t,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if dcfg is None:
        out = launch(cfg, select="all")
    else:
        out = launch(dcfg, select="decode", num_items=s + 1)
        out = launch(cfg, select="prefill", prior=out)
    return from_launch_layout(out, t, hq)


def launch_rows(
    qg,  # [Tp, >= Hkv, Gp, D] (ragged_batch.to_launch_layout; more groups for a fused q|k|v)
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
    cfg: dict,  # resolve_config(...)
    *, t, select, num_items=None, max_q_len=None, prior=None, sm_scale, soft_cap, sliding_window, interpret,
    k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """One pallas_call over the work items of `select` rows (triton_schedule.build_work_items); returns
    [Tp, Hkv, Gp, D] in q's dtype. `prior` (k_splits == 1 only): an output to write into, aliased; rows
    this launch skips keep it. k_scale, v_scale: as in ragged_paged_attention (fp8 pages only)."""
    tp, _, gp, d = qg.shape
    hkv = k_pages.shape[0]
    quantized = is_fp8(k_pages.dtype)
    block_tables = md.block_tables
    b = block_tables.shape[1]
    block_q, ppb, k_splits = cfg["block_q"], cfg["pages_per_block"], cfg["k_splits"]
    if prior is not None and k_splits != 1:
        raise ValueError("writing into a prior output needs k_splits == 1")
    items = build_work_items(
        md, num_tokens=t, block_q=block_q, select=select, num_items=num_items, max_q_len=max_q_len
    )
    w = items.seq.shape[0]
    # Split launches run on N program slots a KV head, dealt out on the device to (item with keys,
    # split) pairs: as many as one sequence's splits or the target's share of a head, and at least one
    # per item. A grid of (items x k_splits) would start every split of every item, padding items too.
    slots = 1
    if k_splits > 1:
        slots = w * k_splits if cfg["split_target"] == 0 else max(w, k_splits, -(-cfg["split_target"] // hkv))
    used = active_splits(
        items, hkv=hkv, k_splits=k_splits, target=cfg["split_target"], block_k=ppb * k_pages.shape[2],
        slots=slots,
    )  # fmt: skip
    deal_item, deal_split = deal_programs(items, used, slots) if k_splits > 1 else (used, used)

    # Block table padded to whole inner steps, so every step reads in-range rows.
    bt = block_tables
    if b % ppb:
        bt = jnp.pad(block_tables, ((0, 0), (0, ppb - b % ppb)))

    scalar_spec = pl.BlockSpec((w,), lambda h, i, c: (0,))
    deal_spec = pl.BlockSpec(deal_item.shape, lambda h, i, c: (0,))
    in_specs = [scalar_spec] * 5 + [
        pl.BlockSpec((1,), lambda h, i, c: (0,)),
        deal_spec,
        deal_spec,
        pl.BlockSpec(bt.shape, lambda h, i, c: (0, 0)),
        pl.BlockSpec((tp, None, gp, d), lambda h, i, c: (0, h, 0, 0)),
        pl.BlockSpec((None, *k_pages.shape[1:]), lambda h, i, c: (h, 0, 0, 0)),
        pl.BlockSpec((None, *v_pages.shape[1:]), lambda h, i, c: (h, 0, 0, 0)),
    ]
    kp = padded_splits(k_splits)
    if k_splits == 1:
        out_shape = jax.ShapeDtypeStruct((tp, hkv, gp, d), qg.dtype)
        out_specs = pl.BlockSpec((tp, None, gp, d), lambda h, i, c: (0, h, 0, 0))
    else:
        out_shape = [
            jax.ShapeDtypeStruct((kp, tp, hkv, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((kp, tp, hkv, gp), jnp.float32),
            jax.ShapeDtypeStruct((kp, tp, hkv, gp), jnp.float32),
        ]  # whole chunks of the merge's loads (triton_combine.padded_splits); splits past k_splits unwritten
        out_specs = [
            pl.BlockSpec((kp, tp, None, gp, d), lambda h, i, c: (0, 0, h, 0, 0)),
            pl.BlockSpec((kp, tp, None, gp), lambda h, i, c: (0, 0, h, 0)),
            pl.BlockSpec((kp, tp, None, gp), lambda h, i, c: (0, 0, h, 0)),
        ]
    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        block_q=block_q,
        pages_per_block=ppb,
        k_splits=k_splits,
        loop_layout=cfg["loop_layout"],
        prefetch_pages=cfg["prefetch_pages"],
        quantized=quantized,
    )
    args = [items.seq, items.q0, items.q1, items.kv_len, items.pos0, used, deal_item, deal_split, bt, qg]
    args += [k_pages, v_pages]
    if quantized:
        in_specs.append(pl.BlockSpec((2,), lambda h, i, c: (0,)))
        args.append(scales_array(k_scale, v_scale))
    aliases = {}
    if prior is not None:
        inner = kernel
        n_in = len(args)

        def kernel(*refs):  # the prior output's input ref is never read: its rows stay as they are
            inner(*refs[:n_in], *refs[n_in + 1 :])

        in_specs.append(out_specs)
        args.append(prior)
        aliases = {n_in: 0}
    variant = ("_masked" if cfg["loop_layout"] == "masked" else "") + ("_pf" if cfg["prefetch_pages"] else "")
    variant += "_fp8" if quantized else ""
    res = pl.pallas_call(
        kernel,
        grid=(hkv, w if k_splits == 1 else slots, 1),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name=f"ragged_paged_attention_{select}_bq{block_q}_ppb{ppb}_ks{k_splits}{variant}",
    )(*args)

    if k_splits == 1:
        return res
    live = live_rows(items, tp)
    return combine_splits(*res, used=used, live=live, out_dtype=qg.dtype, interpret=interpret)
