"""Causal prefill attention over the paged KV cache as a Mosaic GPU kernel (Hopper: wgmma, TMA, mbarriers).

Same contract as ref_ragged_paged_attention (no soft cap, no sliding window); built for prefill chunks,
where the Triton kernel stays at about half of cuDNN's TFLOP/s.

Data flow of one call:
  1. `work_items` (a few small XLA ops) cuts the flattened batch into work items of TILE = 2 * block_q
     query rows of one sequence: (block-table row, tile index, kv_len, position of the first row).
     With q_tile_aligned=True item w is rows [w * TILE, (w + 1) * TILE) of q itself; otherwise each
     sequence's chunk is first gathered into a copy of q padded to whole tiles (TMA into swizzled
     shared memory needs tile rows that start at multiples of 8), and the output is gathered back.
     Items are ranked longest causal length first.
  2. A persistent grid of `num_ctas` CTAs (one per SM) shares the (item, q head) units: round r of the
     ranked units goes to the CTAs in snake order, which balances their causal work. A CTA has three
     warpgroups:
       - warpgroups 0 and 1 (compute) each own block_q rows of the tile. Each loads its Q rows by TMA
         (the next unit's Q already while it works on this one), then walks the KV blocks its last row
         can see: S = Q K^T (wgmma, f32 accumulator), online softmax in f32 (exp2, the scale folded
         into one FMA), O += P V (wgmma, P from registers, O accumulated in place). Blocks wholly below
         the first row's position and inside kv_len skip the mask. With the schedule barrier the two
         warpgroups take turns on the tensor cores, so one's softmax overlaps the other's matmuls.
         Each normalises its rows and writes them back through its Q buffer by TMA.
       - warpgroup 2 (memory) streams K/V blocks of block_kv tokens into a `stages`-deep ring of
         shared-memory slots, running ahead across unit boundaries. A block is block_kv / page_size
         pages scattered in the pool: each page is its own TMA copy (page id read from the block table
         in global memory), all copies of a block arrive on one barrier. A slot is refilled once both
         compute warpgroups have released it (warpgroup 0 releases the blocks past its causal limit
         without computing on them).

Garbage in the pool cannot leak: scores outside [0, kv_len) and above the diagonal are *selected* to
-inf, the running max starts finite (so a row that sees nothing yields p = 0, never NaN), and in the
block that holds kv_len warpgroup 1 zeroes the V rows at and past kv_len in shared memory before either
warpgroup's P V (0 * NaN would be NaN). Pages past a sequence's last page are never read: their slots
repeat its last page.

Checked on the CPU: Mosaic GPU interpret mode against the jnp reference (with its race detector and its
check that every barrier phase is observed), and lowering for the "cuda" platform of the compiled
forms (tests/kernels/test_mosaic_prefill.py). Speed against cuDNN and the Triton kernel: benchmarks/prefill_mgpu.py.

Shapes (dimension letters as in jaxllm/kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; kv_lens i32[S]; block_tables i32[S, B]; cu_q_lens i32[S + 1]; num_seqs i32[1].
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.mosaic_schedule import (
    COMPUTE_WGS,
    KV_LEN,
    POS0,
    SEQ,
    SMEM_LIMIT,
    TILE,
    MgpuConfig,
    Unit,
    cdiv,
    default_config,
    kv_steps,
    unit_schedule,
    work_items,
)
from jaxllm.kernels.reference import check_inputs

_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite: exp2(-inf - _M_INIT) == 0, so fully masked rows stay 0 instead of NaN


def _kernel(
    items_ref,  # i32[4, W] (GMEM)
    bt_ref,  # i32[S, B] (GMEM)
    q_ref,  # [Tq, Hq, D] (GMEM): q, or its copy with each chunk padded to whole tiles
    k_ref,  # [Hkv, P, PS, D] (GMEM)
    v_ref,  # [Hkv, P, PS, D] (GMEM)
    o_ref,  # [Tq, Hq, D] (GMEM)
    q_smem,  # [2, q_buffers, block_q, D]: per compute warpgroup one Q buffer, or two (the unit's and
    #          the next's); a unit's output leaves through its Q buffer
    k_smem,  # [stages, block_kv, D]
    v_smem,  # [stages, block_kv, D]
    q_bar,  # [2 * q_buffers]: Q buffer j of warpgroup g at q_buffers * g + j
    k_full,  # [stages], block_kv / PS arrivals (one per page copy)
    v_full,  # [stages]
    k_free,  # [stages], 2 arrivals (both compute warpgroups release every block)
    v_free,  # [stages]
    turn_bar,  # [1], 2 arrivals: the tensor-core turn of the two compute warpgroups
    v_fixed,  # [stages]: warpgroup 1 has zeroed the V rows past kv_len in that slot. One per slot:
    #           warpgroup 1 cannot complete a slot's barrier twice before warpgroup 0 has waited
    #           (refilling the slot needs warpgroup 0's release), so no phase is skipped
    p_smem,  # [2, block_q, block_kv] P of each compute warpgroup (pv_mode "smem"), else None
    *,
    cfg: MgpuConfig,
    sm_scale: float,
    num_q_heads: int,
    group: int,
    num_units: int,
    grid: int,
):
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.stages
    ps = k_ref.shape[2]
    d = q_ref.shape[2]
    ppb = bk // ps
    b = bt_ref.shape[1]
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    my_units, unit_of = unit_schedule(lax.axis_index("p"), num_units, grid)

    def unit(k) -> Unit:
        u = unit_of(k)
        item = u // num_q_heads
        kv_len = items_ref[KV_LEN, item]
        pos0 = items_ref[POS0, item]
        n0, _ = kv_steps(kv_len, pos0, bq, bk)
        n1, _ = kv_steps(kv_len, pos0 + bq, bq, bk)
        return Unit(
            head=u % num_q_heads,
            seq=items_ref[SEQ, item],
            row0=items_ref[TILE, item] * cfg.tile,
            kv_len=kv_len,
            pos0=pos0,
            n0=n0,
            n_cta=jnp.maximum(n0, n1),
        )

    def take_turn():
        if cfg.schedule_barrier:
            plgpu.barrier_arrive(turn_bar.at[0])
            plgpu.barrier_wait(turn_bar.at[0])

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(cfg.compute_registers, action="increase")
        scale = sm_scale * _LOG2E  # scores in log2 units: p = exp2(s * scale - m)

        def load_q(k, buf):
            un = unit(k)
            src = q_ref.at[pl.ds(un.row0 + wg * bq, bq), un.head]
            plgpu.copy_gmem_to_smem(src, q_smem.at[wg, buf], q_bar.at[cfg.q_buffers * wg + buf])

        nbuf = cfg.q_buffers
        if nbuf == 2:
            pl.when(my_units > 0)(lambda: load_q(0, 0))

        def do_unit(k, g0):  # g0: global index (over this CTA's units) of the unit's first KV block
            un = unit(k)
            buf = lax.rem(k, nbuf)
            qo = q_smem.at[wg, buf]
            if nbuf == 2:  # prefetch the next unit's Q into the other buffer

                @pl.when(k + 1 < my_units)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # unit k-1's output has left it
                    load_q(k + 1, 1 - buf)

            else:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # unit k-1's output has left the buffer
                load_q(k, buf)

            pos_first = un.pos0 + wg * bq
            n_me, full_me = kv_steps(un.kv_len, pos_first, bq, bk)
            plgpu.barrier_wait(q_bar.at[cfg.q_buffers * wg + buf])
            acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
            m_i = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

            # Warpgroup 1 starts one turn behind warpgroup 0 (and warpgroup 0 ends with the spare turn).
            pl.when(wg == 1)(take_turn)

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(g0 + i, stages)
                plgpu.barrier_wait(k_full.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    row = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
                    col = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
                    kv_pos = col + i * bk
                    visible = (kv_pos <= row + pos_first) & (kv_pos < un.kv_len)
                    s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                if cfg.schedule_barrier:
                    plgpu.barrier_arrive(turn_bar.at[0])
                plgpu.barrier_wait(v_full.at[slot])
                if masked:
                    # The block holding kv_len: warpgroup 1 (which visits every block warpgroup 0
                    # does) zeroes V rows past kv_len; warpgroup 0 waits for that. Once per unit.
                    keep = un.kv_len - i * bk
                    pl.when((keep < bk) & (wg == 1))(
                        lambda: _zero_v_tail(v_smem.at[slot], keep, v_fixed.at[slot], bq)
                    )
                    pl.when((keep < bk) & (wg == 0))(lambda: plgpu.barrier_wait(v_fixed.at[slot]))
                if cfg.schedule_barrier:
                    plgpu.barrier_wait(turn_bar.at[0])

                if cfg.pv_mode == "regs":
                    # P straight from registers; O accumulates in the wgmma accumulator itself.
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:
                    p_mine = p_smem.at[wg]
                    p_mine[...] = p16
                    plgpu.commit_smem()

                    def pv(o_acc):
                        plgpu.wgmma(o_acc, p_mine, v_smem.at[slot])
                        return o_acc[...]

                    acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(0, full_me, functools.partial(step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(full_me, n_me, functools.partial(step, masked=True), carry)

            # Blocks only warpgroup 1 visits: keep taking (empty) turns so it is never left waiting,
            # and wait for / release every block like warpgroup 1, so both arrive on every "free"
            # phase and every barrier phase is observed (interpret mode checks that). v_fixed after
            # the second turn: warpgroup 1 arrives on it only after that turn.
            @pl.loop(n_me, un.n_cta)
            def _(i):
                take_turn()
                take_turn()
                slot = lax.rem(g0 + i, stages)
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                pl.when(un.kv_len - i * bk < bk)(lambda: plgpu.barrier_wait(v_fixed.at[slot]))
                plgpu.barrier_arrive(v_free.at[slot])

            pl.when(wg == 0)(take_turn)

            out = acc / lax.broadcast_in_dim(jnp.where(l_i == 0.0, 1.0, l_i), acc.shape, [0])
            qo[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo, o_ref.at[pl.ds(un.row0 + wg * bq, bq), un.head])
            return g0 + un.n_cta

        lax.fori_loop(0, my_units, do_unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(cfg.memory_registers, action="decrease")

        def fill(g, slot, pages, kv_head, src, dst, full, free):
            pl.when(g >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))
            for j, page in enumerate(pages):
                plgpu.copy_gmem_to_smem(src.at[kv_head, page], dst.at[slot, pl.ds(j * ps, ps)], full.at[slot])

        def do_unit(k, g0):
            un = unit(k)
            kv_head = un.head // group
            last_page = jnp.maximum(cdiv(un.kv_len, ps) - 1, 0)

            @pl.loop(0, un.n_cta)
            def _(i):
                g = g0 + i
                slot = lax.rem(g, stages)
                # Page ids first: their global loads overlap the wait for the slot. Blocks past the
                # sequence's last page repeat it (masked anyway) rather than read unlisted pages.
                pages = [
                    bt_ref[un.seq, jnp.minimum(jnp.minimum(i * ppb + j, last_page), b - 1)]
                    for j in range(ppb)
                ]
                fill(g, slot, pages, kv_head, k_ref, k_smem, k_full, k_free)
                fill(g, slot, pages, kv_head, v_ref, v_smem, v_full, v_free)

            return g0 + un.n_cta

        total = lax.fori_loop(0, my_units, do_unit, jnp.int32(0))

        # Observe the releases of the last blocks too (every barrier phase is waited for once).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(g):
            plgpu.barrier_wait(k_free.at[lax.rem(g, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(g, stages)])


def _zero_v_tail(v_slot, keep, v_fixed, bq: int):
    """Zeroes rows >= keep of a [block_kv, D] V slot (rows past kv_len may hold NaN garbage)."""
    bk = v_slot.shape[0]
    for r0 in range(0, bk, bq):
        part = v_slot.at[pl.ds(r0, bq)]
        v = plgpu.load(part, layout=plgpu.Layout.WGMMA)
        row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA) + r0
        part[...] = jnp.where(row < keep, v, jnp.zeros_like(v))
    plgpu.commit_smem()  # the generic-proxy stores become visible to wgmma (async proxy)
    plgpu.barrier_arrive(v_fixed)


def _validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, cfg: MgpuConfig):
    check_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, dtypes=(jnp.bfloat16, jnp.float16)
    )
    d, ps = q.shape[2], k_pages.shape[2]
    if ps < 8 or cfg.block_kv % ps:
        raise ValueError(f"page_size={ps} must be a power of two >= 8 dividing block_kv={cfg.block_kv}")
    if (need := cfg.smem_bytes(d, q.dtype.itemsize)) > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {need} bytes of shared memory at head_dim={d}; at most {SMEM_LIMIT}")


def _check_aligned(cu_q_lens, num_seqs, tile: int):
    """With concrete inputs, the q_tile_aligned precondition is checked here; under jit it cannot be."""
    try:
        cu = np.asarray(cu_q_lens)
        num_seqs = np.asarray(num_seqs)
    except jax.errors.TracerArrayConversionError:
        return
    n = int(np.clip(num_seqs[0], 0, cu.shape[0] - 1))
    bad = [i for i in range(n) if (cu[i] % tile) or ((cu[i + 1] - cu[i]) % tile)]
    if bad:
        raise ValueError(
            f"q_tile_aligned=True needs every sequence's q chunk to start at and span a multiple of "
            f"{tile} rows; sequences {bad[:8]} do not (cu_q_lens={cu[: n + 1].tolist()[:16]}). "
            "Pad the chunks or pass q_tile_aligned=False."
        )


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132  # 132: H100/H200 SXM (also off-GPU)


def _interpret_params(interpret):
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


@functools.partial(jax.jit, static_argnames=("sm_scale", "q_tile_aligned", "min_q_len", "config", "interpret"))
def _prefill(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    q_tile_aligned,
    min_q_len,
    config,
    interpret,
):
    cfg = config
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    items = work_items(
        kv_lens, cu_q_lens, num_seqs, num_tokens=t, cfg=cfg, aligned=q_tile_aligned, min_q_len=min_q_len
    )
    if q_tile_aligned:
        # TMA views the rows in tiles of 8: the row count must be a multiple of it (a copy otherwise).
        q_in = q if t % cfg.tile == 0 else jnp.pad(q, ((0, -t % cfg.tile), (0, 0), (0, 0)))
    else:
        q_in = q[items.q_row]  # [W * TILE, Hq, D]
    tiling = plgpu.TilingTransform((8, 128 // q.dtype.itemsize))
    swizzle = plgpu.SwizzleTransform(128)
    ppb = cfg.block_kv // k_pages.shape[2]
    smem = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=(tiling, swizzle))
    scratch = [
        smem(COMPUTE_WGS, cfg.q_buffers, cfg.block_q, d),  # q_smem
        smem(cfg.stages, cfg.block_kv, d),  # k_smem
        smem(cfg.stages, cfg.block_kv, d),  # v_smem
        plgpu.Barrier(num_barriers=cfg.q_buffers * COMPUTE_WGS),  # q_bar
        plgpu.Barrier(num_arrivals=ppb, num_barriers=cfg.stages),  # k_full
        plgpu.Barrier(num_arrivals=ppb, num_barriers=cfg.stages),  # v_full
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),  # k_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),  # v_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1),  # turn_bar
        plgpu.Barrier(num_barriers=cfg.stages),  # v_fixed
        smem(COMPUTE_WGS, cfg.block_q, cfg.block_kv) if cfg.pv_mode == "smem" else None,  # p_smem
    ]
    num_units = items.table.shape[1] * hq
    grid = min(cfg.num_ctas or _num_sms(), num_units) if cfg.persistent else num_units
    kernel = functools.partial(
        _kernel,
        cfg=cfg,
        sm_scale=float(sm_scale),
        num_q_heads=hq,
        group=hq // hkv,
        num_units=num_units,
        grid=grid,
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        scratch_types=scratch,
        grid=(grid,),
        grid_names=("p",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret),
        kernel_name=f"prefill_paged_attention_mgpu_bkv{cfg.block_kv}_st{cfg.stages}",
    )(items.table, block_tables, q_in, k_pages, v_pages)
    if q_tile_aligned:
        return out[:t]
    gathered = out[items.out_row]
    return jnp.where(items.row_valid[:, None, None], gathered, jnp.zeros_like(gathered))


def prefill_paged_attention_mgpu(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    kv_lens,  # i32[S]
    block_tables,  # i32[S, B]
    cu_q_lens,  # i32[S + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    q_tile_aligned: bool = False,
    min_q_len: int = 1,
    config: MgpuConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
):
    """Causal attention of prefill chunks over the paged KV cache (Hopper, Mosaic GPU).

    Same contract and result as ref_ragged_paged_attention without soft cap or sliding window:
    rows of sequence s sit at positions kv_lens[s] - q_len + i and see keys at positions <= their own
    and < kv_lens[s]; rows past cu_q_lens[num_seqs] come out zero.

    Preconditions (not checked under jit): 0 <= cu_q_lens[s] <= cu_q_lens[s + 1] <= T for the real
    sequences; block_tables[s] lists at least cdiv(kv_lens[s], PS) valid page ids; page ids past that
    are never read. q_tile_aligned=True additionally needs every real sequence's q chunk to start at
    and span a multiple of TILE = 2 * config.block_q (128) rows; it then writes rows in place and
    skips the gather of q_tile_aligned=False. With concrete (non-traced) cu_q_lens/num_seqs that is
    checked and a ValueError raised. min_q_len (q_tile_aligned=False only): sequences with fewer query
    rows are left to another kernel; their rows come out zero, and the padded copy of q is bounded by
    T / TILE + T / min_q_len tiles instead of T / TILE + S.
    Supported: bf16/fp16, head_dim 64/128/256 (256: block_kv 64 and one Q buffer, to fit shared
    memory), page size a power of two >= 8 dividing block_kv, any Hq multiple of Hkv. Cost of
    q_tile_aligned=False: a gather of q into (T / TILE + S) * TILE padded rows and one of the output
    back. The kernel needs an sm_90 GPU; interpret=True (or an InterpretGPUParams) runs it in Mosaic
    GPU interpret mode on the CPU, with pv_mode "smem" (slow; for tests).
    """
    cfg = default_config(q.shape[-1]) if config is None else config
    if interpret:
        cfg = dataclasses.replace(cfg, pv_mode="smem")
    _validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, cfg)
    if min_q_len < 1 or (q_tile_aligned and min_q_len > 1):
        raise ValueError(f"min_q_len={min_q_len} must be >= 1, and 1 with q_tile_aligned=True")
    if q_tile_aligned:
        _check_aligned(cu_q_lens, num_seqs, cfg.tile)
    if interpret:
        # XLA CPU runs a computation whose inputs are still being computed later, on its own small
        # thread pool. The interpreter's warpgroup threads block inside host callbacks until the
        # others arrive at a barrier, and blocked callbacks on that pool can starve it. With ready
        # inputs the computation runs on this thread and its warpgroups on threads of their own.
        jax.block_until_ready((q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs))
    return _prefill(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=float(sm_scale),
        q_tile_aligned=q_tile_aligned,
        min_q_len=int(min_q_len),
        config=cfg,
        interpret=interpret,
    )
