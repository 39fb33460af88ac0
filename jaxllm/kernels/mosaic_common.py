"""What the two Mosaic GPU attention kernels (mosaic_decode.py, mosaic_prefill.py) have in common.

Both are persistent Hopper kernels with the same skeleton: one CTA per SM takes its share of the
(work unit, head) pairs (unit_schedule); in each CTA, compute warpgroups multiply wgmma tiles of Q
(64 rows, loaded by TMA) with K/V blocks, and one memory warpgroup streams those blocks from the paged
cache into a ring of `stages` shared-memory slots (stream_kv_blocks):

  memory warpgroup, per KV block           compute warpgroup(s), per KV block
  wait k_free[slot] (once the ring is      wait k_full[slot]; S = Q K^T (score_tile); arrive k_free[slot]
    full); a TMA copy per page of K,       online softmax in float32 (softmax_update)
    all arriving on k_full[slot]           wait v_full[slot]; O += P V (accumulate_pv); arrive v_free[slot]
  the same for V (v_free, v_full)

A block is block_kv tokens, block_kv / page_size pages scattered in the pool: each page is its own TMA
copy, its id read from the block table in global memory, and all copies of a block arrive on one
barrier. The memory warpgroup runs ahead across unit boundaries, so the stream does not stop between
units. Garbage in the pool (NaN in unused pages or past kv_len) cannot leak: scores past the context
are selected to -inf, the running max starts finite (M_INIT), and in the block holding the end of the
context the V rows past it are zeroed in shared memory before P V (zero_v_tail), since 0 * NaN is NaN.

The kernels differ in their units (decode: one query row and KV head; prefill: a 128-row tile and a
query head, two compute warpgroups taking turns on the tensor cores) and in their masks; those stay in
their own files.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.metadata import PagedAttentionMetadata, check_inputs

LOG2E = math.log2(math.e)
M_INIT = (
    -1e30
)  # running max at the start: finite, so exp2(-inf - M_INIT) == 0 and a row that sees nothing stays 0
WGMMA_ROWS = 64  # rows of one warpgroup's wgmma tile (its M)
SMEM_LIMIT = 227 * 1024 - 2048  # Hopper per-CTA maximum, less room for barriers and reductions
PV_MODES = ("regs", "smem")
DTYPES = (jnp.bfloat16, jnp.float16)


def cdiv(a, b):
    return (a + b - 1) // b


def check_ring(block_kv: int, stages: int, num_ctas: int | None, pv_mode: str) -> None:
    """The KV ring and grid fields both kernels' configs share; a ValueError names the field."""
    if block_kv % 64 or not 64 <= block_kv <= 256:
        raise ValueError(f"block_kv={block_kv} must be 64, 128, 192 or 256")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    if num_ctas is not None and num_ctas < 1:
        raise ValueError(f"num_ctas={num_ctas} must be >= 1 or None")
    if pv_mode not in PV_MODES:
        raise ValueError(f"pv_mode={pv_mode!r} must be 'regs' or 'smem'")


def check_mosaic_inputs(q, k_pages, v_pages, md: PagedAttentionMetadata, cfg) -> None:
    """The attention contract (bf16/fp16 only), pages that divide a KV block into whole TMA copies, and
    the config's shared memory."""
    check_inputs(q, k_pages, v_pages, md, dtypes=DTYPES)
    d, ps = q.shape[2], k_pages.shape[2]
    if ps < 8 or cfg.block_kv % ps:
        raise ValueError(f"page_size={ps} must be a power of two >= 8 dividing block_kv={cfg.block_kv}")
    if (need := cfg.smem_bytes(d, q.dtype.itemsize)) > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {need} bytes of shared memory at head_dim={d}; at most {SMEM_LIMIT}")


def for_interpret(cfg, interpret):
    """Interpret mode models neither register wgmma operands nor run_state accumulators: P goes
    through shared memory there (pv_mode "smem")."""
    return dataclasses.replace(cfg, pv_mode="smem") if interpret else cfg


def wait_for_inputs(interpret, args) -> None:
    """In interpret mode, block until the inputs are computed. XLA CPU runs a computation whose inputs
    are still being computed later, on its own small thread pool. The interpreter's warpgroup threads
    block inside host callbacks until the others arrive at a barrier, and blocked callbacks on that
    pool can starve it. With ready inputs the computation runs on this thread and its warpgroups on
    threads of their own."""
    if interpret:
        jax.block_until_ready(args)


def num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132  # 132: H100/H200 SXM (also off-GPU)


def unit_schedule(pid, num_units: int, grid: int):
    """(number of units, k -> k-th unit) of CTA pid. Round r of `grid` units goes to the CTAs in snake
    order (even rounds ascending, odd ones descending): with units ranked longest-first that balances
    the CTAs' work without a dynamic queue."""
    rounds, rem = divmod(num_units, grid)
    last_pos = jnp.where(rounds % 2 == 0, pid, grid - 1 - pid)
    count = rounds + (last_pos < rem).astype(jnp.int32)

    def unit_of(k):
        return k * grid + jnp.where(k % 2 == 0, pid, grid - 1 - pid)

    return count, unit_of


# ---- inside the kernels ---------------------------------------------------------------------------


def init_softmax_state(rows: int, d: int):
    """(O accumulator f32[rows, D], running max f32[rows], running sum f32[rows]) in wgmma layouts."""
    acc = plgpu.layout_cast(jnp.zeros((rows, d), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((rows,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    return acc, m_i, l_i


def score_tile(q_buf, k_slot, block_kv: int, after_issue=None):
    """S = Q K^T (f32[rows, block_kv]) by wgmma from shared memory; after_issue runs between issuing
    the wgmma and reading its result (the prefill kernel's tensor-core turn)."""
    rows = q_buf.shape[0]

    def qk(s_ref):
        plgpu.wgmma(s_ref, q_buf, k_slot.transpose((1, 0)))
        if after_issue is not None:
            after_issue()
        return s_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((rows, block_kv), jnp.float32))


def softmax_update(s, acc, m_i, l_i, scale: float, dtype):
    """One online-softmax step over a block of (masked) scores s; scores are scaled into log2 units
    with one multiply (scale = sm_scale * log2 e), so p = exp2(s * scale - m). Returns the rescaled
    accumulator, the new max and sum, and P in the input dtype for P V."""
    m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i = l_i * alpha + p.sum(axis=1)
    return acc, m_new, l_i, p.astype(dtype)


def accumulate_pv(acc, p16, v_slot, *, pv_mode: str, p_buf):
    """O += P V. "regs": P straight from registers, O accumulated in the wgmma accumulator itself
    (pl.run_state). "smem": P staged in p_buf (shared memory) and P V into a fresh accumulator added to
    O: the form interpret mode runs."""
    if pv_mode == "regs":

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_slot)

        return pl.run_state(pv)(plgpu.ACC.init(acc))
    p_buf[...] = p16
    plgpu.commit_smem()

    def pv(o_acc):
        plgpu.wgmma(o_acc, p_buf, v_slot)
        return o_acc[...]

    return acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))


def zero_v_tail(v_slot, keep, rows: int = WGMMA_ROWS):
    """Zeroes rows >= keep of a [block_kv, D] V slot, `rows` at a time (rows past the context may hold
    NaN garbage), and makes the stores visible to wgmma (the async proxy)."""
    bk = v_slot.shape[0]
    for r0 in range(0, bk, rows):
        part = v_slot.at[pl.ds(r0, rows)]
        v = plgpu.load(part, layout=plgpu.Layout.WGMMA)
        row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA) + r0
        part[...] = jnp.where(row < keep, v, jnp.zeros_like(v))
    plgpu.commit_smem()


def write_output(acc, l_i, buf, dtype) -> None:
    """O / l (0 for rows that saw no key) written into the unit's Q buffer, which wgmma is done with, and
    made visible to the TMA copy that takes it to global memory."""
    out = acc / lax.broadcast_in_dim(jnp.where(l_i == 0.0, 1.0, l_i), acc.shape, [0])
    buf[...] = out.astype(dtype)
    plgpu.commit_smem()


def stream_kv_blocks(
    my_units,
    unit_blocks,  # k -> (block-table row, KV head, context length, KV blocks) of this CTA's k-th unit
    *,
    bt_ref,  # i32[S, B] (GMEM)
    k_ref,  # [Hkv, P, PS, D] (GMEM)
    v_ref,  # [Hkv, P, PS, D] (GMEM)
    k_smem,  # [stages, block_kv, D]
    v_smem,  # [stages, block_kv, D]
    k_full,  # [stages], block_kv / PS arrivals (one per page copy)
    v_full,  # [stages]
    k_free,  # [stages], one arrival per compute warpgroup
    v_free,  # [stages]
    block_kv: int,
    stages: int,
) -> None:
    """The memory warpgroup: streams the K/V blocks of this CTA's units into the ring, in the order the
    compute warpgroups consume them (g counts blocks over all the CTA's units)."""
    ps = k_ref.shape[2]
    ppb = block_kv // ps
    b = bt_ref.shape[1]

    def fill(g, slot, pages, head, src, dst, full, free):
        pl.when(g >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))
        for j, page in enumerate(pages):
            plgpu.copy_gmem_to_smem(src.at[head, page], dst.at[slot, pl.ds(j * ps, ps)], full.at[slot])

    def do_unit(k, g0):
        seq, kv_head, kv_len, n_blocks = unit_blocks(k)
        last_page = jnp.maximum(cdiv(kv_len, ps) - 1, 0)

        @pl.loop(0, n_blocks)
        def _(i):
            g = g0 + i
            slot = lax.rem(g, stages)
            # Page ids first: their global loads overlap the wait for the slot. Blocks past the
            # unit's last page repeat it (masked anyway) rather than read unlisted pages.
            pages = [bt_ref[seq, jnp.minimum(jnp.minimum(i * ppb + j, last_page), b - 1)] for j in range(ppb)]
            fill(g, slot, pages, kv_head, k_ref, k_smem, k_full, k_free)
            fill(g, slot, pages, kv_head, v_ref, v_smem, v_full, v_free)

        return g0 + n_blocks

    total = lax.fori_loop(0, my_units, do_unit, jnp.int32(0))

    # Observe the releases of the last blocks too (every barrier phase is waited for once).
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(g):
        plgpu.barrier_wait(k_free.at[lax.rem(g, stages)])
        plgpu.barrier_wait(v_free.at[lax.rem(g, stages)])


# ---- launching ------------------------------------------------------------------------------------


def smem_tiles(dtype):
    """shape -> shared-memory buffer of `dtype` in the TMA/wgmma layout (8-row tiles, 128-byte swizzle)."""
    tiling = plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize))
    swizzle = plgpu.SwizzleTransform(128)
    return lambda *shape: plgpu.SMEM(shape, dtype, transforms=(tiling, swizzle))


def kv_ring_barriers(pages_per_block: int, stages: int, releases: int) -> list:
    """[k_full, v_full, k_free, v_free] of the ring: a full barrier completes when all page copies of a
    block have landed, a free one when all `releases` compute warpgroups are done with the slot."""
    return [
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),  # k_full
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),  # v_full
        plgpu.Barrier(num_arrivals=releases, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=releases, num_barriers=stages),  # v_free
    ]


def launch(kernel, *, out_type, scratch, grid: int, num_threads: int, interpret, name: str):
    """plgpu.kernel over a 1-D grid "p" of CTAs with `num_threads` warpgroups "wg". interpret: True or
    plgpu.InterpretGPUParams (Mosaic GPU interpret mode on the CPU)."""
    if not isinstance(interpret, plgpu.InterpretGPUParams):
        interpret = plgpu.InterpretGPUParams() if interpret else None
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(grid,),
        grid_names=("p",),
        num_threads=num_threads,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        kernel_name=name,
    )
