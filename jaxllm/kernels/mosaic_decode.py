"""Paged decode attention as a persistent Mosaic GPU kernel (Hopper: TMA, wgmma, mbarriers).

Same contract as ref_ragged_paged_attention (no soft cap, no sliding window), built for decode-like
batches: every query row is its own unit of work, so a row of a short chunk costs a whole pass over
its context. For decode rows that is exactly the work; the Triton kernel in
triton_attention.py loses bandwidth at short contexts because each of its programs fills a
software pipeline for a few KV steps and then drains it.

Data flow of one call:
  1. `decode_rows` (a few small XLA ops): for each row t of the flattened batch, its block-table row
     and how many keys it sees. A row at position p of its sequence (p = kv_len - q_len + i) sees keys
     [0, p], so `ctx` = p + 1 (the whole context for a decode row); padding rows get ctx 0.
  2. q is viewed as [T, Hkv, R, D]: the query heads of one KV head (GQA group), padded with zero heads
     to R, a multiple of 8 (TMA moves whole 8-row tiles).
  3. A persistent grid of `num_ctas` CTAs (one per SM) deals the (row, KV head) units round by round
     (rpa_mgpu_schedule.unit_schedule). A CTA has two warpgroups:
       - warpgroup 0 (compute) loads a unit's R query rows by TMA into a 64-row Q buffer (wgmma's M;
         the next unit's Q loads into the other buffer meanwhile) and walks the unit's KV blocks:
         S = Q K^T (wgmma, f32), online softmax in f32 (exp2, scale folded in), O += P V (wgmma).
         Rows past R hold stale values: rows never mix in these products, and only rows [0, R) are
         stored, by TMA, through the same buffer.
       - warpgroup 1 (memory) streams the K and V blocks (block_kv tokens = block_kv / PS pages, one
         TMA copy per page, page ids read from the block table in global memory) into a `stages`-deep
         ring, running ahead across unit boundaries: the next unit's first pages load while the current
         unit's last block is computed, so the stream does not stop between units.

Garbage in the pool cannot leak: in the block holding the end of the context, scores past ctx are
selected to -inf and the V rows past it are zeroed in shared memory before P V (0 * NaN would be
NaN); pages past a row's last page are never read (their slots repeat its last page).

Checked on the CPU: Mosaic GPU interpret mode against the jnp reference, and lowering for the "cuda"
platform (tests/kernels/test_mosaic_decode.py). Speed against the Triton kernel: benchmarks/decode_mgpu.py.

Shapes (dimension letters as in jaxllm/kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; kv_lens i32[S]; block_tables i32[S, B]; cu_q_lens i32[S + 1]; num_seqs i32[1].
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

from jaxllm.kernels.mosaic_schedule import SMEM_LIMIT, cdiv, unit_schedule
from jaxllm.kernels.reference import check_inputs

_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite: exp2(-inf - _M_INIT) == 0
BLOCK_Q = 64  # rows of the Q tile: wgmma's M for one warpgroup
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
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"block_kv={self.block_kv} must be 64, 128, 192 or 256")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"num_ctas={self.num_ctas} must be >= 1 or None")
        if self.pv_mode not in ("regs", "smem"):
            raise ValueError(f"pv_mode={self.pv_mode!r} must be 'regs' or 'smem'")

    def smem_bytes(self, d: int, itemsize: int) -> int:
        p_tile = BLOCK_Q * self.block_kv if self.pv_mode == "smem" else 0
        return ((2 * BLOCK_Q + 2 * self.stages * self.block_kv) * d + p_tile) * itemsize


def group_rows(hq: int, hkv: int) -> int:
    """R: the query heads of one KV head, rounded up to whole 8-row TMA tiles."""
    return cdiv(hq // hkv, 8) * 8


def decode_rows(kv_lens, cu_q_lens, num_seqs, num_tokens: int, *, only_decode: bool = False):
    """i32[2, T]: per row, its block-table row (SEQ) and the keys it sees (CTX: position + 1; 0 for
    padding rows, and with only_decode for rows of sequences with more than one query row, which
    another kernel takes). The owner of row t is the number of sequences ending at or before it: a
    vectorised compare, not searchsorted (whose binary search is a while loop: a host round trip on
    the GPU)."""
    s = kv_lens.shape[0]
    n = jnp.clip(num_seqs[0], 0, s)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.sum(cu_q_lens[1:][None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
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
    ps = k_ref.shape[2]
    d = q_ref.shape[3]
    r = q_ref.shape[2]
    ppb = bk // ps
    b = bt_ref.shape[1]
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    my_units, unit_of = unit_schedule(lax.axis_index("p"), num_units, grid)

    def unit(k):
        u = unit_of(k)
        row = u // num_kv_heads
        return row, u % num_kv_heads, rows_ref[SEQ, row], rows_ref[CTX, row]

    @pl.when(wg == 0)
    def _compute():
        scale = sm_scale * _LOG2E  # scores in log2 units: p = exp2(s * scale - m)

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

            n_blocks = cdiv(ctx, bk)
            n_full = ctx // bk
            plgpu.barrier_wait(q_bar.at[buf])
            acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, d), jnp.float32), plgpu.Layout.WGMMA)
            m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(g0 + i, stages)
                plgpu.barrier_wait(k_full.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, bk), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(col + i * bk < ctx, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                plgpu.barrier_wait(v_full.at[slot])
                if masked:  # the block holding the end of the context: V rows past it may be NaN
                    _zero_v_tail(v_smem.at[slot], ctx - i * bk)
                if cfg.pv_mode == "regs":

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:
                    p_smem[...] = p16
                    plgpu.commit_smem()

                    def pv(o_acc):
                        plgpu.wgmma(o_acc, p_smem, v_smem.at[slot])
                        return o_acc[...]

                    acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
            out = acc / lax.broadcast_in_dim(jnp.where(l_i == 0.0, 1.0, l_i), acc.shape, [0])
            qo[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo.at[pl.ds(0, r)], o_ref.at[row, head])
            return g0 + n_blocks

        lax.fori_loop(0, my_units, do_unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        def fill(g, slot, pages, head, src, dst, full, free):
            pl.when(g >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))
            for j, page in enumerate(pages):
                plgpu.copy_gmem_to_smem(src.at[head, page], dst.at[slot, pl.ds(j * ps, ps)], full.at[slot])

        def do_unit(k, g0):
            _, head, seq, ctx = unit(k)
            n_blocks = cdiv(ctx, bk)
            last_page = jnp.maximum(cdiv(ctx, ps) - 1, 0)

            @pl.loop(0, n_blocks)
            def _(i):
                g = g0 + i
                slot = lax.rem(g, stages)
                # Page ids first: their global loads overlap the wait for the slot. Pages past the
                # row's last one repeat it (masked anyway) rather than read unlisted pages.
                pages = [
                    bt_ref[seq, jnp.minimum(jnp.minimum(i * ppb + j, last_page), b - 1)] for j in range(ppb)
                ]
                fill(g, slot, pages, head, k_ref, k_smem, k_full, k_free)
                fill(g, slot, pages, head, v_ref, v_smem, v_full, v_free)

            return g0 + n_blocks

        total = lax.fori_loop(0, my_units, do_unit, jnp.int32(0))

        # Observe the releases of the last blocks too (every barrier phase is waited for once).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(g):
            plgpu.barrier_wait(k_free.at[lax.rem(g, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(g, stages)])


def _zero_v_tail(v_slot, keep):
    """Zeroes rows >= keep of a [block_kv, D] V slot, 64 rows at a time, and makes the stores visible
    to wgmma (the async proxy)."""
    bk = v_slot.shape[0]
    for r0 in range(0, bk, BLOCK_Q):
        part = v_slot.at[pl.ds(r0, BLOCK_Q)]
        v = plgpu.load(part, layout=plgpu.Layout.WGMMA)
        row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA) + r0
        part[...] = jnp.where(row < keep, v, jnp.zeros_like(v))
    plgpu.commit_smem()


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132  # 132: H100/H200 SXM (also off-GPU)


def _interpret_params(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, cfg: DecodeMgpuConfig):
    check_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, dtypes=(jnp.bfloat16, jnp.float16)
    )
    hq, d = q.shape[1:]
    hkv, _, ps, _ = k_pages.shape
    if ps < 8 or cfg.block_kv % ps:
        raise ValueError(f"page_size={ps} must be a power of two >= 8 dividing block_kv={cfg.block_kv}")
    if group_rows(hq, hkv) > BLOCK_Q:
        raise ValueError(f"{hq // hkv} query heads per KV head: at most {BLOCK_Q} fit one Q tile")
    if (need := cfg.smem_bytes(d, q.dtype.itemsize)) > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {need} bytes of shared memory at head_dim={d}; at most {SMEM_LIMIT}")


def decode_launch(qg, k_pages, v_pages, rows, block_tables, *, sm_scale, config, interpret):
    """The kernel on q in group layout: qg [Tq, Hkv, R, D] (R a multiple of 8), rows = decode_rows(...)
    over the Tq rows. Returns [Tq, Hkv, R, D]; a row with CTX 0 comes out zero."""
    cfg = config
    tq, hkv, _, d = qg.shape
    tiling = plgpu.TilingTransform((8, 128 // qg.dtype.itemsize))
    swizzle = plgpu.SwizzleTransform(128)
    smem = lambda *shape: plgpu.SMEM(shape, qg.dtype, transforms=(tiling, swizzle))
    ppb = cfg.block_kv // k_pages.shape[2]
    scratch = [
        smem(2, BLOCK_Q, d),  # q_smem
        smem(cfg.stages, cfg.block_kv, d),  # k_smem
        smem(cfg.stages, cfg.block_kv, d),  # v_smem
        plgpu.Barrier(num_barriers=2),  # q_bar
        plgpu.Barrier(num_arrivals=ppb, num_barriers=cfg.stages),  # k_full
        plgpu.Barrier(num_arrivals=ppb, num_barriers=cfg.stages),  # v_full
        plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),  # k_free
        plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),  # v_free
        smem(BLOCK_Q, cfg.block_kv) if cfg.pv_mode == "smem" else None,  # p_smem
    ]
    num_units = tq * hkv
    grid = min(cfg.num_ctas or _num_sms(), num_units)
    kernel = functools.partial(
        _kernel, cfg=cfg, sm_scale=float(sm_scale), num_kv_heads=hkv, num_units=num_units, grid=grid
    )
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        scratch_types=scratch,
        grid=(grid,),
        grid_names=("p",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret),
        kernel_name=f"decode_paged_attention_mgpu_bkv{cfg.block_kv}_st{cfg.stages}",
    )(rows, block_tables, qg, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def _decode(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, config, interpret):
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    g, r = hq // hkv, group_rows(hq, hkv)
    qg = q.reshape(t, hkv, g, d)
    if r != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r - g), (0, 0)))
    rows = decode_rows(kv_lens, cu_q_lens, num_seqs, t)
    out = decode_launch(
        qg, k_pages, v_pages, rows, block_tables, sm_scale=sm_scale, config=config, interpret=interpret
    )
    return out[:, :, :g].reshape(t, hq, d)


def decode_paged_attention_mgpu(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    kv_lens,  # i32[S]
    block_tables,  # i32[S, B]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
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
    sequences; block_tables[s] lists at least cdiv(kv_lens[s], PS) valid page ids; page ids past that
    are never read. Supported: bf16/fp16, head_dim 64/128/256 (256 needs a smaller ring: stages * block_kv
    <= 128), page size a power of two >= 8 dividing block_kv, up to 64 query heads per KV head. The
    kernel needs an sm_90 GPU; interpret=True (or an InterpretGPUParams) runs it in Mosaic GPU
    interpret mode on the CPU, with pv_mode "smem" (slow; for tests).
    """
    cfg = DecodeMgpuConfig() if config is None else config
    if interpret:
        cfg = dataclasses.replace(cfg, pv_mode="smem")
    validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, cfg)
    if interpret:
        # As in ragged_paged_attention_mgpu: with ready inputs the XLA CPU computation runs on this
        # thread and the interpreted warpgroups on threads of their own (no starved callback pool).
        jax.block_until_ready((q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs))
    return _decode(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=float(sm_scale), config=cfg, interpret=interpret,
    )  # fmt: skip
