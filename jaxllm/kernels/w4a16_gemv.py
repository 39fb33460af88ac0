"""W4A16 product for a handful of rows (decode at concurrency 1-8) without the tensor cores: y[M, N] =
x[M, K] @ w[K, N], w as 4-bit codes in the canonical int4 layout (int4_reference.py), M <= MAX_ROWS.

Why a second kernel beside w4a16_matmul.py: at M = 1 that kernel pads its rows to the dot's 16, keeps a
[16, bn] accumulator and the dot operands' layouts in registers and shared memory (159 registers and
74 KB of shared memory a program on sm_90: three programs an SM), and reaches about a fifth of the
memory bandwidth. A matrix-vector product needs none of that: each weight is used once per row, so the
work is a multiply-add per weight on the CUDA cores, and a program needs only its tile of codes. Small
programs, many of them (split-K), keep enough loads in flight to read the codes at the bandwidth.

Data flow of one program (j, c): columns [j bn, (j + 1) bn), its share c of the K steps (split_steps).
Per step of bk inputs (one group or less, so one scale row): load the packed codes u8[bk/2, bn]; the
low nibbles are the even inputs, the high nibbles the odd ones. Each code q becomes Q = 1 + q/16 in
float32 with a shift and one bitwise op (`_codes_unit`: the code into the top four mantissa bits of
1.0; no int-to-float conversion, which issues at a quarter of the ALU rate, and no subtraction). With
w = (q - z) s = (16 Q - 16 - z) s, per row r of x (unrolled, r < M):
    part = sum over the tile's rows of x_even * Q_lo + x_odd * Q_hi
    acc_r += part * s - sum(x_r over the step) * (1 + z/16) s          (f32; s, z the group's [bn] row)
and y_r = 16 acc_r. split_k == 1 writes the rows in x's dtype; split_k > 1 writes float32 partials
that one XLA reduction adds.

Its loads wait for memory at every step unless told otherwise: Triton pipelines a loop with no dot only
when the loop asks, and Pallas' lowering does not (the profile is in docs/quantized_performance.md). Two
knobs, both off until measured on a GPU: `pipeline` names the kernel *_loopstages{num_stages}, which the
lowering hook jaxllm.compat.pipeline_named_triton_loops (installed by layers/linear.py; the kernels import
nothing of jaxllm) turns into asynchronous copies num_stages - 1 steps ahead; `prefetch` issues each step's
loads a step ahead itself and carries them in registers.

Constraints (ValueError): M <= MAX_ROWS, g divides K and is a multiple of 32, N % 16 == 0, bn and bk
powers of two, bk <= g, bk divides g, bn divides N.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.kernels.w4a16_matmul import (
    _check_inputs,
    check_split_and_launch,
    split_k_call,
    split_steps,
    without_empty_splits,
)

__all__ = ["GEMV_KNOBS", "MAX_ROWS", "default_gemv_config", "w4a16_gemv"]

MAX_ROWS = 8
GEMV_KNOBS = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "prefetch", "pipeline")
# Programs split-K aims for: about eight an SM of an H100/H200 (132 SMs). Each is small (no shared
# memory of its own beyond the pipeline's code tiles), so several share an SM and their loads overlap.
TARGET_PROGRAMS = 1056
ONE_BITS = 0x3F800000  # 1.0 as float32 bits
CODE_FIELD = 0xF << 19  # the top four mantissa bits: ONE_BITS | q << 19 is 1 + q / 16 exactly
CODE_SCALE = 16.0  # w = (q - z) s = (16 Q - 16 - z) s with Q = 1 + q / 16


def _codes_unit(shifted):  # u32 with a code at bits 19..22 (other bits anything) -> f32 1 + q / 16
    return lax.bitcast_convert_type((shifted & CODE_FIELD) | ONE_BITS, jnp.float32)


def _gemv_kernel(
    x_ref,  # [M, K]
    qw_ref,  # u8[K/2, bn]
    s_ref,  # [K/g, bn]
    z_ref,  # [K/g, bn]
    o_ref,  # [M, bn]
    *,
    block_k: int,
    group_size: int,
    num_steps: int,
    split_k,
    prefetch: bool,
):
    rows = x_ref.shape[0]
    lo, hi = split_steps(num_steps, pl.program_id(1), split_k)
    half = block_k // 2
    bn = o_ref.shape[-1]

    def load(step):  # what a step reads: its codes, its group's scale and zero rows, its inputs
        k0 = pl.multiple_of(step * block_k, block_k)
        group = k0 // group_size
        return (
            qw_ref[pl.ds(pl.multiple_of(step * half, half), half), :],  # u8[bk/2, bn]
            s_ref[pl.ds(group, 1), :],  # [1, bn]
            z_ref[pl.ds(group, 1), :],
            tuple(x_ref[pl.ds(r, 1), pl.ds(k0, block_k)] for r in range(rows)),  # [1, bk] each
        )

    def body(step, carry):  # accs: f32[1, bn] per row (and with prefetch, this step's loads)
        if prefetch:  # the next step's loads go out before this step's arithmetic, which hides them
            accs, tiles = carry
            ahead = load(jnp.minimum(step + 1, hi - 1))  # the last step reloads its own tiles (cached)
        else:
            accs, tiles = carry, load(step)
        packed, s, z, xs = tiles
        packed = packed.astype(jnp.uint32)
        q_lo = _codes_unit(packed << 19)  # inputs k0, k0 + 2, ...: 1 + q / 16
        q_hi = _codes_unit(packed << 15)  # inputs k0 + 1, k0 + 3, ...
        s = s.astype(jnp.float32)  # f32[1, bn]
        zs = (z.astype(jnp.float32) / CODE_SCALE + 1.0) * s  # (16 + z) s / 16
        out = []
        for r in range(rows):
            x = xs[r].astype(jnp.float32)  # [1, bk]
            x_even, x_odd = (v[:, None] for v in jnp.unstack(x.reshape(half, 2), axis=-1))  # [bk/2, 1]
            part = jnp.sum(x_even * q_lo + x_odd * q_hi, axis=0, keepdims=True)  # [1, bn]
            out.append(accs[r] + part * s - jnp.sum(x) * zs)
        return (tuple(out), ahead) if prefetch else tuple(out)

    init = tuple(jnp.zeros((1, bn), jnp.float32) for _ in range(rows))
    if prefetch:  # the first step's loads (an empty split's index clamped into range: its loop does not run)
        accs, _ = lax.fori_loop(lo, hi, body, (init, load(jnp.minimum(lo, num_steps - 1))))
    else:
        accs = lax.fori_loop(lo, hi, body, init)
    for r in range(rows):
        o_ref[pl.ds(r, 1), :] = (CODE_SCALE * accs[r]).astype(o_ref.dtype)


def default_gemv_config(m: int, k: int, n: int, group_size: int) -> dict:
    """bn 128 columns (a packed row of codes: 128 bytes), bk 128 inputs or the group if smaller (halved
    until it divides the group), split_k for TARGET_PROGRAMS programs (at most the step count, with no empty run)."""
    bn = 128
    while n % bn:
        bn //= 2
    bk = min(128, group_size)
    while group_size % bk:
        bk //= 2
    steps = k // bk
    split_k = max(1, min(-(-TARGET_PROGRAMS // (n // bn)), steps))
    split_k = without_empty_splits(steps, split_k)
    return dict(
        block_n=bn, block_k=bk, split_k=split_k, num_warps=4, num_stages=3, prefetch=False, pipeline=False
    )


def resolve_gemv_config(m: int, k: int, n: int, group_size: int, **knobs) -> dict:
    unknown = set(knobs) - set(GEMV_KNOBS)
    if unknown:
        raise ValueError(f"unknown tuning knobs {sorted(unknown)}; known: {GEMV_KNOBS}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"w4a16_gemv takes 1 to {MAX_ROWS} rows of x, got {m}: use w4a16_matmul")
    cfg = default_gemv_config(m, k, n, group_size)
    cfg.update({name: v for name, v in knobs.items() if v is not None})
    for name, least in (("block_n", 16), ("block_k", 32)):
        v = cfg[name]
        if not isinstance(v, int) or v < least or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= {least}")
    for name in ("prefetch", "pipeline"):
        if not isinstance(cfg[name], bool):
            raise ValueError(f"{name}={cfg[name]!r} must be True or False")
    if n % cfg["block_n"]:
        raise ValueError(f"block_n={cfg['block_n']} must divide N={n} (qweight.shape[1])")
    if group_size % cfg["block_k"]:
        raise ValueError(f"block_k={cfg['block_k']} must divide the group size {group_size}")
    check_split_and_launch(cfg, k // cfg["block_k"])
    return cfg


@functools.partial(jax.jit, static_argnames=("interpret", *GEMV_KNOBS))
def w4a16_gemv(
    x,  # [M, K]  bf16 / f16 / f32, M <= MAX_ROWS
    qweight,  # u8[K/2, N]
    scales,  # [K/g, N]
    zeros,  # [K/g, N]
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool | None = None,
    pipeline: bool | None = None,
    interpret: bool = False,
):  # -> [M, N] in x's dtype
    """x @ ((q - zeros) * scales), accumulated in float32: ref_w4a16_matmul up to summation order."""
    g = _check_inputs(x, qweight, scales, zeros)
    m, k = x.shape
    n = qweight.shape[1]
    cfg = resolve_gemv_config(
        m, k, n, g, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
        num_stages=num_stages, prefetch=prefetch, pipeline=pipeline,
    )  # fmt: skip
    bn, bk, split = cfg["block_n"], cfg["block_k"], cfg["split_k"]
    in_specs = [
        pl.BlockSpec((m, k), lambda j, c: (0, 0)),
        pl.BlockSpec((k // 2, bn), lambda j, c: (0, j)),
        pl.BlockSpec((scales.shape[0], bn), lambda j, c: (0, j)),
        pl.BlockSpec((zeros.shape[0], bn), lambda j, c: (0, j)),
    ]
    kernel = functools.partial(
        _gemv_kernel, block_k=bk, group_size=g, num_steps=k // bk, split_k=split, prefetch=cfg["prefetch"]
    )
    name = f"w4a16_gemv_bn{bn}_bk{bk}_sk{split}" + ("_prefetch" if cfg["prefetch"] else "")
    if cfg["pipeline"]:  # the step loop's loads as asynchronous copies, num_stages - 1 steps ahead
        name += f"_loopstages{cfg['num_stages']}"  # honoured by jaxllm.compat.pipeline_named_triton_loops
    return split_k_call(kernel, (x, qweight, scales, zeros), in_specs, (n // bn, split), lambda j, c: (c, j), bn,
                        cfg, name, interpret)  # fmt: skip
