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

Constraints (ValueError): M <= MAX_ROWS, g divides K and is a multiple of 32, N % 16 == 0, bn and bk
powers of two, bk <= g, bk divides g, bn divides N.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.w4a16_matmul import (
    _check_inputs,
    check_split_and_launch,
    split_k_call,
    split_steps,
    without_empty_splits,
)

__all__ = ["GEMV_KNOBS", "MAX_ROWS", "UNPACKS", "default_gemv_config", "w4a16_gemv"]

MAX_ROWS = 8
GEMV_KNOBS = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "unpack")
UNPACKS = ("bytes", "words")
# Programs split-K aims for: about eight an SM of an H100/H200 (132 SMs). Each is small (no shared
# memory of its own beyond the pipeline's code tiles), so several share an SM and their loads overlap.
TARGET_PROGRAMS = 1056
ONE_BITS = 0x3F800000  # 1.0 as float32 bits
CODE_FIELD = 0xF << 19  # the top four mantissa bits: ONE_BITS | q << 19 is 1 + q / 16 exactly
CODE_SCALE = 16.0  # w = (q - z) s = (16 Q - 16 - z) s with Q = 1 + q / 16
# "words": byte c of a word shifted by WORD_BYTE_SHIFTS[c] has its high nibble at bits 19..22 and its
# low one at 15..18 (Q_lo = 1 + q / 256): one shift for two codes; the even inputs are weighted 16
# (LOW_CODE_WEIGHT, exact) so that both halves of a byte add up on the same 1/16 scale
WORD_BYTE_SHIFTS = (15, 7, -1, -9)
LOW_CODE_FIELD = 0xF << 15
LOW_CODE_WEIGHT = 16.0


def _codes_unit(shifted):  # u32 with a code at bits 19..22 (other bits anything) -> f32 1 + q / 16
    return lax.bitcast_convert_type((shifted & CODE_FIELD) | ONE_BITS, jnp.float32)


def _gemv_kernel(
    x_ref,  # [M, K]
    qw_ref,  # u8[K/2, bn] ("bytes") or u32[K/2, bn/4] ("words")
    s_ref,  # [K/g, bn]
    z_ref,  # [K/g, bn]
    o_ref,  # [M, bn]
    *,
    block_k: int,
    group_size: int,
    num_steps: int,
    split_k,
    unpack: str,
    interpret: bool,
):
    rows = x_ref.shape[0]
    lo, hi = split_steps(num_steps, pl.program_id(1), split_k)
    half = block_k // 2
    bn = o_ref.shape[-1]
    # "words": a strip of columns per byte of the word (columns c, c + 4, ... of the block), each with
    # its own accumulator; "bytes": one strip of every column
    strips = [pl.ds(c, bn // 4, stride=4) for c in range(4)] if unpack == "words" else [pl.ds(0, bn)]
    width = bn // len(strips)
    even_weight = LOW_CODE_WEIGHT if unpack == "words" else 1.0

    def body(step, accs):  # accs[r][strip]: f32[1, width]
        k0 = pl.multiple_of(step * block_k, block_k)
        rows_k = pl.ds(pl.multiple_of(step * half, half), half)
        group = k0 // group_size
        xs = []
        for r in range(rows):
            x = x_ref[pl.ds(r, 1), pl.ds(k0, block_k)].astype(jnp.float32)  # [1, bk]
            x_even, x_odd = (v[:, None] for v in jnp.unstack(x.reshape(half, 2), axis=-1))  # [bk/2, 1]
            x_sum = jnp.sum(x, keepdims=True)  # [1, 1]
            ones = x_sum  # the step's sum of x times the 1 in each Q
            if even_weight != 1.0:
                x_even = x_even * even_weight
                evens = x_ref[pl.ds(r, 1), pl.ds(k0, half, stride=2)].astype(jnp.float32)  # [1, bk/2]
                ones = x_sum + (even_weight - 1.0) * jnp.sum(evens, keepdims=True)
            xs.append((x_even, x_odd, ones, x_sum))
        if unpack == "words":
            words = qw_ref[rows_k, :]  # u32[bk/2, bn/4]: byte c of word j holds column 4j + c
            codes = [_byte_codes(_shift(words, shift), interpret) for shift in WORD_BYTE_SHIFTS]
        else:
            packed = qw_ref[rows_k, :].astype(jnp.uint32)
            # inputs k0, k0 + 2, ... / k0 + 1, k0 + 3, ...
            codes = [(_codes_unit(packed << 19), _codes_unit(packed << 15))]
        out = [list(a) for a in accs]
        s_all = _strips(s_ref[pl.ds(group, 1), :].astype(jnp.float32), len(strips))
        z_all = _strips(z_ref[pl.ds(group, 1), :].astype(jnp.float32), len(strips))
        for i, (q_lo, q_hi) in enumerate(codes):
            s = s_all[i]  # f32[1, width]
            zs = z_all[i] / CODE_SCALE * s  # z s / 16
            for r, (x_even, x_odd, ones, x_sum) in enumerate(xs):
                prod = x_even * q_lo + x_odd * q_hi  # [bk/2, width]
                if wide:  # summed over the tile's rows once, after the loop
                    out[r][i] = (out[r][i][0] + prod * s, out[r][i][1] - ones * s - x_sum * zs)
                else:
                    part = jnp.sum(prod, axis=0, keepdims=True)  # [1, width]
                    out[r][i] = out[r][i] + (part - ones) * s - x_sum * zs
        return tuple(tuple(a) for a in out)

    # one row ("words"): a [bk/2, width] accumulator a strip (and a [1, width] one for the offsets), so
    # no sum across threads in the loop
    wide = unpack == "words" and rows == 1
    zero = lambda h: jnp.zeros((h, width), jnp.float32)  # noqa: E731
    init = tuple(tuple((zero(half), zero(1)) if wide else zero(1) for _ in strips) for _ in range(rows))
    accs = lax.fori_loop(lo, hi, body, init)
    for r in range(rows):
        for strip, acc in zip(strips, accs[r]):
            if wide:
                acc = jnp.sum(acc[0], axis=0, keepdims=True) + acc[1]
            o_ref[pl.ds(r, 1), strip] = (CODE_SCALE * acc).astype(o_ref.dtype)


def _strips(row, n: int):  # [1, bn] -> n rows [1, bn / n], strip c = columns c, c + n, ...
    if n == 1:
        return [row]
    bn = row.shape[-1]
    pairs = jnp.unstack(row.reshape(bn // 4, 2, 2), axis=-1)  # column 4j + 2t + u -> pairs[u][j, t]
    quads = [jnp.unstack(p, axis=-1) for p in pairs]  # quads[u][t][j]
    return [quads[c % 2][c // 2].reshape(1, bn // 4) for c in range(4)]


def _shift(words, left: int):  # words << left, or >> -left
    return words << left if left >= 0 else words >> -left


def _byte_codes(shifted, interpret: bool):
    """One byte's two codes from a word shifted so that its high nibble sits at bits 19..22 and its low
    nibble at 15..18: (1 + q_lo / 256, 1 + q_hi / 16) as float32, one bitwise op each. On the GPU that op
    is a single lop3 ((w & field) | 1.0's bits: two constants, which the compiler otherwise spends two
    instructions on, as lop3 takes one immediate)."""
    out = []
    for field in (LOW_CODE_FIELD, CODE_FIELD):
        if interpret:
            bits = (shifted & field) | ONE_BITS
        else:
            [bits] = plgpu.elementwise_inline_asm(
                f"lop3.b32 $0, $1, {field:#010x}, {ONE_BITS:#010x}, 0xea;",
                args=[shifted], constraints="=r,r", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(shifted.shape, jnp.int32)],  # Triton: signless
            )  # fmt: skip
        out.append(lax.bitcast_convert_type(bits, jnp.float32))
    return tuple(out)


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
    return dict(block_n=bn, block_k=bk, split_k=split_k, num_warps=4, num_stages=3, unpack="bytes")


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
    if cfg["unpack"] not in UNPACKS:
        raise ValueError(f"unpack={cfg['unpack']!r} must be one of {UNPACKS}")
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
    unpack: str | None = None,
    interpret: bool = False,
):  # -> [M, N] in x's dtype
    """x @ ((q - zeros) * scales), accumulated in float32: ref_w4a16_matmul up to summation order."""
    g = _check_inputs(x, qweight, scales, zeros)
    m, k = x.shape
    n = qweight.shape[1]
    cfg = resolve_gemv_config(
        m, k, n, g, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
        num_stages=num_stages, unpack=unpack,
    )  # fmt: skip
    bn, bk, split = cfg["block_n"], cfg["block_k"], cfg["split_k"]
    codes, code_cols = qweight, bn
    if cfg["unpack"] == "words":  # the same bytes read four to a word: u32[K/2, N/4], byte c = column 4j + c
        codes, code_cols = lax.bitcast_convert_type(qweight.reshape(k // 2, n // 4, 4), jnp.uint32), bn // 4
    in_specs = [
        pl.BlockSpec((m, k), lambda j, c: (0, 0)),
        pl.BlockSpec((k // 2, code_cols), lambda j, c: (0, j)),
        pl.BlockSpec((scales.shape[0], bn), lambda j, c: (0, j)),
        pl.BlockSpec((zeros.shape[0], bn), lambda j, c: (0, j)),
    ]
    kernel = functools.partial(
        _gemv_kernel,
        block_k=bk,
        group_size=g,
        num_steps=k // bk,
        split_k=split,
        unpack=cfg["unpack"],
        interpret=interpret,
    )
    name = f"w4a16_gemv_{cfg['unpack']}_bn{bn}_bk{bk}_sk{split}"
    return split_k_call(kernel, (x, codes, scales, zeros), in_specs, (n // bn, split), lambda j, c: (c, j), bn,
                        cfg, name, interpret)  # fmt: skip
