"""Paged decode attention as a persistent Mosaic GPU kernel (Hopper: TMA, wgmma, mbarriers).

Same contract as ref_ragged_paged_attention (no soft cap, no sliding window), built for decode-like
batches: every query row is its own unit of work, so a row of a short chunk costs a whole pass over
its context. For decode rows that is exactly the work. Why a second decode kernel next to the Triton
one: each Triton program fills a software pipeline for a few KV steps and then drains it, which loses
bandwidth at short contexts; here one CTA per SM streams the blocks of unit after unit without a break.
The dispatcher (hopper_dispatch.py) sends large decode batches here.

Data flow of one call:
  1. `decode_rows` (a few small XLA ops): for each row t of the flattened batch, its block-table row
     and how many keys it sees. A row at position p of its sequence (p = kv_len - q_len + i) sees keys
     [0, p], so `ctx` = p + 1 (the whole context for a decode row); padding rows get ctx 0.
  2. q is viewed as [T, Hkv, R, D]: the query heads of one KV head (GQA group), padded with zero heads
     to R, a multiple of 8 (TMA moves whole 8-row tiles).
  3. A persistent grid of `num_ctas` CTAs (one per SM) deals the (row, KV head) units round by round
     (mosaic_common.unit_schedule). A CTA has two warpgroups:
       - warpgroup 0 (compute) loads a unit's R query rows by TMA into a 64-row Q buffer (wgmma's M;
         the next unit's Q loads into the other buffer meanwhile) and walks the unit's KV blocks:
         S = Q K^T (wgmma, f32), online softmax in f32 (exp2, scale folded in), O += P V (wgmma).
         Rows past R hold stale values: rows never mix in these products, and only rows [0, R) are
         stored, by TMA, through the same buffer.
       - warpgroup 1 (memory) streams the K and V blocks (block_kv tokens = block_kv / PS pages) into a
         `stages`-deep ring (mosaic_common.stream_kv_blocks), running ahead across unit boundaries.

Garbage in the pool cannot leak: in the block holding the end of the context, scores past ctx are
selected to -inf and the V rows past it are zeroed in shared memory before P V; pages past a row's last
page are never read (their slots repeat its last page).

Shapes (dimension letters as in jaxllm/kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; md: metadata.PagedAttentionMetadata of S sequences.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mosaic_common as mc
from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.ragged_batch import owner

BLOCK_Q = mc.WGMMA_ROWS  # rows of the Q tile: one warpgroup's wgmma M
SEQ, CTX = range(2)  # rows of the per-row table


@dataclasses.dataclass(frozen=True)
class DecodeMgpuConfig:
    """Static tuning of the decode kernel."""

    block_kv: int = 64  # tokens per KV block (block_kv / page_size pages, one TMA copy each)
    stages: int = 4  # KV blocks in flight (shared-memory ring depth)
    num_ctas: int | None = None  # CTAs of the persistent grid; None: the device's SM count
    # "regs": P V takes P from registers and accumulates into O in place (pl.run_state). "smem": P is
    # staged in shared memory and P V goes to a fresh accumulator added to O (what interpret mode runs).
    pv_mode: str = "regs"

    def __post_init__(self):
        mc.check_ring(self.block_kv, self.stages, self.num_ctas, self.pv_mode)

    def smem_bytes(self, d: int, itemsize: int) -> int:
        p_tile = BLOCK_Q * self.block_kv if self.pv_mode == "smem" else 0
        return ((2 * BLOCK_Q + 2 * self.stages * self.block_kv) * d + p_tile) * itemsize


def group_rows(hq: int, hkv: int) -> int:
    """R: the query heads of one KV head, rounded up to whole 8-row TMA tiles."""
    return mc.cdiv(hq // hkv, 8) * 8


def decode_rows(md: PagedAttentionMetadata, num_tokens: int, *, only_decode: bool = False):
    """i32[2, T]: per row, its block-table row (SEQ) and the keys it sees (CTX: position + 1; 0 for
    padding rows, and with only_decode for rows of sequences with more than one query row, which
    another kernel takes)."""
    kv_lens, cu_q_lens = md.kv_lens, md.cu_q_lens
    s = kv_lens.shape[0]
    n = jnp.clip(md.num_seqs[0], 0, s)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = owner(cu_q_lens[1:], rows)
    valid = (seq < n) & (rows < cu_q_lens[n])
    seq = jnp.minimum(seq, s - 1)
    start, end = cu_q_lens[seq], cu_q_lens[seq + 1]
    if only_decode:
        valid &= end - start == 1
    kvl = kv_lens[seq]
    ctx = jnp.clip(kvl - (end - start) + (rows - start) + 1, 0, kvl)
    ctx = jnp.where(valid, ctx, 0)
    return jnp.stack([jnp.where(valid, seq, 0), ctx]).astype(jnp.int32)


def _kernel(
    rows_ref,  # i32[2, T] (GMEM): SEQ, CTX per row
    bt_ref,  # i32[S, B] (GMEM)
    q_ref,  # [T, Hkv, R, D] (GMEM)
    k_ref,  # [Hkv, P, PS, D] (GMEM)
    v_ref,  # [Hkv, P, PS, D] (GMEM)
    o_ref,  # [T, Hkv, R, D] (GMEM)
    q_smem,  # [2, BLOCK_Q, D]: the unit's Q buffer and the next unit's; the output leaves through it
    k_smem,  # [stages, block_kv, D]
    v_smem,  # [stages, block_kv, D]
    q_bar,  # [2]
    k_full,  # [stages], block_kv / PS arrivals (one per page copy)
    v_full,  # [stages]
    k_free,  # [stages], 1 arrival (the compute warpgroup releases every block)
    v_free,  # [stages]
    p_smem,  # [BLOCK_Q, block_kv] P (pv_mode "smem"), else None
    *,
    cfg: DecodeMgpuConfig,
    sm_scale: float,
    num_kv_heads: int,
    num_units: int,
    grid: int,
):
    bk, stages = cfg.block_kv, cfg.stages
    d = q_ref.shape[3]
    r = q_ref.shape[2]
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    my_units, unit_of = mc.unit_schedule(lax.axis_index("p"), num_units, grid)

    def unit(k):
        u = unit_of(k)
        row = u // num_kv_heads
        return row, u % num_kv_heads, rows_ref[SEQ, row], rows_ref[CTX, row]

    @pl.when(wg == 0)
    def _compute():
        scale = sm_scale * mc.LOG2E  # scores in log2 units: p = exp2(s * scale - m)

        def load_q(k, buf):
            row, head, _, _ = unit(k)
            plgpu.copy_gmem_to_smem(q_ref.at[row, head], q_smem.at[buf, pl.ds(0, r)], q_bar.at[buf])

        pl.when(my_units > 0)(lambda: load_q(0, 0))

        def do_unit(k, g0):  # g0: index (over this CTA's units) of the unit's first KV block
            row, head, _, ctx = unit(k)
            buf = lax.rem(k, 2)
            qo = q_smem.at[buf]

            @pl.when(k + 1 < my_units)
            def _():  # the next unit's Q goes into the other buffer once unit k-1's output has left it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load_q(k + 1, 1 - buf)

            n_blocks = mc.cdiv(ctx, bk)
            n_full = ctx // bk
            plgpu.barrier_wait(q_bar.at[buf])

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(g0 + i, stages)
                plgpu.barrier_wait(k_full.at[slot])
                s = mc.score_tile(qo, k_smem.at[slot], bk)
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, bk), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(col + i * bk < ctx, s, -jnp.inf)
                acc, m_new, l_i, p16 = mc.softmax_update(s, acc, m_i, l_i, scale, dtype)
                plgpu.barrier_wait(v_full.at[slot])
                if masked:  # the block holding the end of the context: V rows past it may be NaN
                    mc.zero_v_tail(v_smem.at[slot], ctx - i * bk)
                acc = mc.accumulate_pv(acc, p16, v_smem.at[slot], pv_mode=cfg.pv_mode, p_buf=p_smem)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = mc.init_softmax_state(BLOCK_Q, d)
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
            acc, _, l_i = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
            mc.write_output(acc, l_i, qo, dtype)
            plgpu.copy_smem_to_gmem(qo.at[pl.ds(0, r)], o_ref.at[row, head])
            return g0 + n_blocks

        lax.fori_loop(0, my_units, do_unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        def unit_blocks(k):
            _, head, seq, ctx = unit(k)
            return seq, head, ctx, mc.cdiv(ctx, bk)

        mc.stream_kv_blocks(
            my_units, unit_blocks, bt_ref=bt_ref, k_ref=k_ref, v_ref=v_ref, k_smem=k_smem, v_smem=v_smem,
            k_full=k_full, v_full=v_full, k_free=k_free, v_free=v_free, block_kv=bk, stages=stages,
        )  # fmt: skip


def check_decode_inputs(q, k_pages, v_pages, md: PagedAttentionMetadata, cfg: DecodeMgpuConfig) -> None:
    mc.check_mosaic_inputs(q, k_pages, v_pages, md, cfg)
    hq, hkv = q.shape[1], k_pages.shape[0]
    if group_rows(hq, hkv) > BLOCK_Q:
        raise ValueError(f"{hq // hkv} query heads per KV head: at most {BLOCK_Q} fit one Q tile")


def decode_launch(
    qg,  # [Tq, Hkv, R, D], R a multiple of 8
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    rows,  # i32[2, Tq]: decode_rows(...) over the Tq rows
    block_tables,  # i32[S, B]
    *,
    sm_scale,
    config,
    interpret,
):
    """The kernel on q in group layout. Returns [Tq, Hkv, R, D]; a row with CTX 0 comes out zero."""
    cfg = config
    tq, hkv, _, d = qg.shape
    smem = mc.smem_tiles(qg.dtype)
    ppb = cfg.block_kv // k_pages.shape[2]
    scratch = [
        smem(2, BLOCK_Q, d),  # q_smem
        smem(cfg.stages, cfg.block_kv, d),  # k_smem
        smem(cfg.stages, cfg.block_kv, d),  # v_smem
        plgpu.Barrier(num_barriers=2),  # q_bar
        *mc.kv_ring_barriers(ppb, cfg.stages, releases=1),  # k_full, v_full, k_free, v_free
        smem(BLOCK_Q, cfg.block_kv) if cfg.pv_mode == "smem" else None,  # p_smem
    ]
    num_units = tq * hkv
    grid = min(cfg.num_ctas or mc.num_sms(), num_units)
    kernel = functools.partial(
        _kernel, cfg=cfg, sm_scale=float(sm_scale), num_kv_heads=hkv, num_units=num_units, grid=grid
    )
    return mc.launch(
        kernel,
        out_type=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        scratch=scratch,
        grid=grid,
        num_threads=2,
        interpret=interpret,
        name=f"decode_paged_attention_mgpu_bkv{cfg.block_kv}_st{cfg.stages}",
    )(rows, block_tables, qg, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def _decode(q, k_pages, v_pages, md, *, sm_scale, config, interpret):
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    g, r = hq // hkv, group_rows(hq, hkv)
    qg = q.reshape(t, hkv, g, d)
    if r != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r - g), (0, 0)))
    rows = decode_rows(md, t)
    out = decode_launch(
        qg, k_pages, v_pages, rows, md.block_tables, sm_scale=sm_scale, config=config, interpret=interpret
    )
    return out[:, :, :g].reshape(t, hq, d)


def decode_paged_attention_mgpu(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
    *,
    sm_scale: float,
    config: DecodeMgpuConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """Attention of every query row over its paged context (Hopper, Mosaic GPU), one row at a time.

    Same contract and result as ref_ragged_paged_attention without soft cap or sliding window: rows of
    sequence s sit at positions kv_lens[s] - q_len + i and see keys at positions <= their own; rows past
    cu_q_lens[num_seqs] come out zero. Meant for decode-like batches (each row reads its whole context,
    so a chunk of n rows costs n passes over it).

    Preconditions (not checked under jit): 0 <= cu_q_lens[s] <= cu_q_lens[s + 1] <= T for the real
    sequences; block_tables[s] lists at least mc.cdiv(kv_lens[s], PS) valid page ids; page ids past that
    are never read. Supported: bf16/fp16, head_dim 64/128/256 (256 needs a smaller ring: stages * block_kv
    <= 128), page size a power of two >= 8 dividing block_kv, up to 64 query heads per KV head. The
    kernel needs an sm_90 GPU; interpret=True (or an InterpretGPUParams) runs it in Mosaic GPU
    interpret mode on the CPU, with pv_mode "smem" (slow; for tests).
    """
    cfg = mc.for_interpret(DecodeMgpuConfig() if config is None else config, interpret)
    check_decode_inputs(q, k_pages, v_pages, md, cfg)
    mc.wait_for_inputs(interpret, (q, k_pages, v_pages, md))
    return _decode(q, k_pages, v_pages, md, sm_scale=float(sm_scale), config=cfg, interpret=interpret)
