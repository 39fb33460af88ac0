"""Causal prefill attention over the paged KV cache as a Mosaic GPU kernel (Hopper: wgmma, TMA, mbarriers).

Same contract as ref_ragged_paged_attention (no soft cap, no sliding window); built for long prefill
chunks, which are compute-bound: the Triton kernel's mma tiles stay far below cuDNN there, while two
warpgroups taking turns on wgmma, fed by TMA, come close to it. The dispatcher (hopper_dispatch.py)
sends long chunks here.

Data flow of one call:
  1. `work_items` (a few small XLA ops) cuts the flattened batch into work items of TILE = 2 * block_q
     query rows of one sequence: (block-table row, tile index, kv_len, position of the first row).
     With q_tile_aligned=True item w is rows [w * TILE, (w + 1) * TILE) of q itself; otherwise each
     sequence's chunk is first gathered into a copy of q padded to whole tiles (TMA into swizzled
     shared memory needs tile rows that start at multiples of 8), and the output is gathered back.
     Items are ranked longest causal length first.
  2. A persistent grid of `num_ctas` CTAs (one per SM) shares the (item, q head) units: round r of the
     ranked units goes to the CTAs in snake order (mosaic_common.unit_schedule), which balances their
     causal work. A CTA has three
     warpgroups:
       - warpgroups 0 and 1 (compute) each own block_q rows of the tile. Each loads its Q rows by TMA
         (the next unit's Q already while it works on this one), then walks the KV blocks its last row
         can see: S = Q K^T (wgmma, f32 accumulator), online softmax in f32 (exp2, the scale folded
         into one FMA), O += P V (wgmma, P from registers, O accumulated in place). Blocks wholly below
         the first row's position and inside kv_len skip the mask. With the schedule barrier the two
         warpgroups take turns on the tensor cores, so one's softmax overlaps the other's matmuls.
         Each normalises its rows and writes them back through its Q buffer by TMA.
       - warpgroup 2 (memory) streams K/V blocks of block_kv tokens into a `stages`-deep ring of
         shared-memory slots, running ahead across unit boundaries (mosaic_common.stream_kv_blocks).
         A slot is refilled once both compute warpgroups have released it (warpgroup 0 releases the
         blocks past its causal limit without computing on them).

Garbage in the pool cannot leak: scores outside [0, kv_len) and above the diagonal are *selected* to
-inf, the running max starts finite (so a row that sees nothing yields p = 0, never NaN), and in the
block that holds kv_len warpgroup 1 zeroes the V rows at and past kv_len in shared memory before either
warpgroup's P V (0 * NaN would be NaN). Pages past a sequence's last page are never read: their slots
repeat its last page.

Shapes (dimension letters as in jaxllm/kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; md: metadata.PagedAttentionMetadata of S sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import mosaic_common as mc
from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.mosaic_schedule import (
    COMPUTE_WGS,
    KV_LEN,
    POS0,
    SEQ,
    TILE,
    MgpuConfig,
    Unit,
    default_config,
    kv_steps,
    work_items,
)


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
    d = q_ref.shape[2]
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    my_units, unit_of = mc.unit_schedule(lax.axis_index("p"), num_units, grid)

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
        p_mine = None if p_smem is None else p_smem.at[wg]  # this warpgroup's P (pv_mode "smem")
        scale = sm_scale * mc.LOG2E  # scores in log2 units: p = exp2(s * scale - m)

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
            state = mc.init_softmax_state(bq, d)

            # Warpgroup 1 starts one turn behind warpgroup 0 (and warpgroup 0 ends with the spare turn).
            pl.when(wg == 1)(take_turn)

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(g0 + i, stages)
                plgpu.barrier_wait(k_full.at[slot])
                s = mc.score_tile(qo, k_smem.at[slot], bk, after_issue=take_turn)
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    row = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
                    col = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
                    kv_pos = col + i * bk
                    visible = (kv_pos <= row + pos_first) & (kv_pos < un.kv_len)
                    s = jnp.where(visible, s, -jnp.inf)
                acc, m_new, l_i, p16 = mc.softmax_update(s, acc, m_i, l_i, scale, dtype)
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                if cfg.schedule_barrier:
                    plgpu.barrier_arrive(turn_bar.at[0])
                plgpu.barrier_wait(v_full.at[slot])
                if masked:
                    # The block holding kv_len: warpgroup 1 (which visits every block warpgroup 0
                    # does) zeroes V rows past kv_len; warpgroup 0 waits for that. Once per unit.
                    keep = un.kv_len - i * bk
                    pl.when((keep < bk) & (wg == 1))(
                        lambda: _fix_v_tail(v_smem.at[slot], keep, v_fixed.at[slot])
                    )
                    pl.when((keep < bk) & (wg == 0))(lambda: plgpu.barrier_wait(v_fixed.at[slot]))
                if cfg.schedule_barrier:
                    plgpu.barrier_wait(turn_bar.at[0])

                acc = mc.accumulate_pv(acc, p16, v_smem.at[slot], pv_mode=cfg.pv_mode, p_buf=p_mine)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = lax.fori_loop(0, full_me, functools.partial(step, masked=False), state)
            acc, _, l_i = lax.fori_loop(full_me, n_me, functools.partial(step, masked=True), carry)

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

            mc.write_output(acc, l_i, qo, dtype)
            plgpu.copy_smem_to_gmem(qo, o_ref.at[pl.ds(un.row0 + wg * bq, bq), un.head])
            return g0 + un.n_cta

        lax.fori_loop(0, my_units, do_unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(cfg.memory_registers, action="decrease")

        def unit_blocks(k):
            un = unit(k)
            return un.seq, un.head // group, un.kv_len, un.n_cta

        mc.stream_kv_blocks(
            my_units, unit_blocks, bt_ref=bt_ref, k_ref=k_ref, v_ref=v_ref, k_smem=k_smem, v_smem=v_smem,
            k_full=k_full, v_full=v_full, k_free=k_free, v_free=v_free, block_kv=bk, stages=stages,
        )  # fmt: skip


def _fix_v_tail(v_slot, keep, v_fixed):
    """Warpgroup 1 zeroes the V rows >= keep of the slot (past kv_len: maybe NaN) and tells warpgroup 0."""
    mc.zero_v_tail(v_slot, keep)
    plgpu.barrier_arrive(v_fixed)


def _check_aligned(md: PagedAttentionMetadata, tile: int):
    """With concrete inputs, the q_tile_aligned precondition is checked here; under jit it cannot be."""
    try:
        cu = np.asarray(md.cu_q_lens)
        num_seqs = np.asarray(md.num_seqs)
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


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "q_tile_aligned", "min_q_len", "config", "interpret")
)
def _prefill(q, k_pages, v_pages, md, *, sm_scale, q_tile_aligned, min_q_len, config, interpret):
    cfg = config
    t, hq, d = q.shape
    hkv = k_pages.shape[0]
    items = work_items(md, num_tokens=t, cfg=cfg, aligned=q_tile_aligned, min_q_len=min_q_len)
    if q_tile_aligned:
        # TMA views the rows in tiles of 8: the row count must be a multiple of it (a copy otherwise).
        q_in = q if t % cfg.tile == 0 else jnp.pad(q, ((0, -t % cfg.tile), (0, 0), (0, 0)))
    else:
        q_in = q[items.q_row]  # [W * TILE, Hq, D]
    ppb = cfg.block_kv // k_pages.shape[2]
    smem = mc.smem_tiles(q.dtype)
    scratch = [
        smem(COMPUTE_WGS, cfg.q_buffers, cfg.block_q, d),  # q_smem
        smem(cfg.stages, cfg.block_kv, d),  # k_smem
        smem(cfg.stages, cfg.block_kv, d),  # v_smem
        plgpu.Barrier(num_barriers=cfg.q_buffers * COMPUTE_WGS),  # q_bar
        *mc.kv_ring_barriers(ppb, cfg.stages, releases=COMPUTE_WGS),  # k_full, v_full, k_free, v_free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1),  # turn_bar
        plgpu.Barrier(num_barriers=cfg.stages),  # v_fixed
        smem(COMPUTE_WGS, cfg.block_q, cfg.block_kv) if cfg.pv_mode == "smem" else None,  # p_smem
    ]
    num_units = items.table.shape[1] * hq
    grid = min(cfg.num_ctas or mc.num_sms(), num_units) if cfg.persistent else num_units
    kernel = functools.partial(
        _kernel,
        cfg=cfg,
        sm_scale=float(sm_scale),
        num_q_heads=hq,
        group=hq // hkv,
        num_units=num_units,
        grid=grid,
    )
    out = mc.launch(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        scratch=scratch,
        grid=grid,
        num_threads=COMPUTE_WGS + 1,
        interpret=interpret,
        name=f"prefill_paged_attention_mgpu_bkv{cfg.block_kv}_st{cfg.stages}",
    )(items.table, md.block_tables, q_in, k_pages, v_pages)
    if q_tile_aligned:
        return out[:t]
    gathered = out[items.out_row]
    return jnp.where(items.row_valid[:, None, None], gathered, jnp.zeros_like(gathered))


def prefill_paged_attention_mgpu(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
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
    cfg = mc.for_interpret(default_config(q.shape[-1]) if config is None else config, interpret)
    mc.check_mosaic_inputs(q, k_pages, v_pages, md, cfg)
    if min_q_len < 1 or (q_tile_aligned and min_q_len > 1):
        raise ValueError(f"min_q_len={min_q_len} must be >= 1, and 1 with q_tile_aligned=True")
    if q_tile_aligned:
        _check_aligned(md, cfg.tile)
    mc.wait_for_inputs(interpret, (q, k_pages, v_pages, md))
    return _prefill(
        q, k_pages, v_pages, md, sm_scale=float(sm_scale), q_tile_aligned=q_tile_aligned,
        min_q_len=int(min_q_len), config=cfg, interpret=interpret,
    )  # fmt: skip
