"""W4A16 GEMM as a Pallas kernel for NVIDIA GPUs (Triton lowering): y[M, N] = x[M, K] @ w[K, N], with w
held as 4-bit codes in the canonical int4 layout (int4_reference.py) and dequantized in registers.

Why: decode reads every weight once per step and does about one multiply-add per weight per token, so
at small M its time is the weight bytes over the memory bandwidth. Four-bit codes are a quarter of
bf16's bytes; dequantizing them to a bf16 copy in memory first (what XLA does with jnp ops) reads the
codes, writes and reads the copy, and loses the saving. Here each tile of codes is loaded once and
turned into matmul operands in registers.

Data flow of one call:
  1. Tiles (bm, bn, bk), split_k and Triton's num_warps / num_stages come from default_config (shapes
     alone), with any the caller passes put over them and checked (resolve_config).
  2. Grid (cdiv(M, bm), N / bn, split_k); the M blocks vary fastest, so programs that read the same
     weight tile run side by side and the second read of a tile comes from L2. Program (i, j, c) owns
     rows [i bm, (i + 1) bm) (x's rows past M are masked to zero, never padded in memory), columns
     [j bn, (j + 1) bn) and its share c of the K steps (split_steps).
  3. Each step of bk inputs is cut into sub-blocks of sub_k = min(bk, g) inputs, so every sub-block lies
     in one quantization group. Per sub-block: load x[bm, sub_k] and split it into its even and odd
     columns in registers (reshape to [bm, sub_k/2, 2], unstack: no strided or interleaved memory
     access); load the packed codes u8[sub_k/2, bn]; low nibbles are the even rows of the dense tile,
     high nibbles the odd rows. With b = CODE_BIAS (bf16 128, f16 1024, f32 0):
         part = x_even @ (q_lo + b) + x_odd @ (q_hi + b)          (operands exact in x's dtype)
         acc += part * s - rowsum(x) * ((z + b) * s)              (f32, s/z the group's [bn] row)
     i.e. sum_k x (q - z) s with the scale and zero applied once per [bm, bn] tile and group instead of
     once per weight: per weight only a mask or a shift and an OR remain (_codes_as says why the bias).
  4. split_k == 1: the program writes its rows (masked to M) in x's dtype. split_k > 1: each split
     writes float32 partial sums and one XLA reduction adds them (for the shapes whose N blocks alone
     are too few programs to keep every SM reading: decode of a 4096-wide output has 32 blocks of 128).

Constraints (ValueError on violation): g divides K and is a multiple of 32 (a sub-block of 32 inputs is
two dot operands of 16, Triton's least), N % 16 == 0; tiles are powers of two with bm, bn >= 16 and
bk >= 32, bk divides K, and bk divides g or g divides bk. Prefill (large M) may be better served by
dequantizing the weight to bf16 once and using XLA's dot; this kernel is tuned for decode.

Why x is split in registers rather than the dense tile interleaved: the dot operand of a byte's two rows
would need the nibbles joined along K (join, transpose, reshape), which Triton lowers through shared
memory with register spills; two dots on the even / odd halves let it read the codes from its pipelined
shared-memory buffer straight into the mma operand layout.

Testing: in interpret mode on the CPU, plus its Triton IR compiled for sm_90 there
(tests/kernels/test_w4a16_matmul.py: Triton's passes map the dots to mma.sync and pipeline the code
loads through cp.async, with no register spills); `--gpu` runs the same cases compiled on a GPU.
Its speed on one (benchmarks/w4a16_matmul.py) is far below the bandwidth bound: docs/performance.md,
"Quantized models", says by how much and what was ruled out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.int4_reference import group_size_of
from jaxllm.kernels.ragged_batch import next_pow2

__all__ = ["DTYPES", "KNOBS", "default_config", "resolve_config", "w4a16_matmul"]

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
DTYPE_NAMES = tuple(jnp.dtype(d).name for d in DTYPES)
KNOBS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
# bf16 / f16 operands are bias + code (_codes_as); the kernel subtracts bias * rowsum(x) with the zero.
CODE_BIAS = {"bfloat16": 128.0, "float16": 1024.0}
CODE_BIAS_BITS = {"bfloat16": 0x4300, "float16": 0x6400}
MIN_DOT = 16  # Triton's dot: every operand dimension >= 16
HIGHEST = lax.Precision.HIGHEST
# Programs the split-K heuristic aims for: two per SM of an H100/H200 (132 SMs), so one slow program
# does not leave an SM idle at the end of the launch.
TARGET_PROGRAMS = 264


def _w4a16_kernel(
    x_ref,  # [M, K]  (every row; this program reads its bm rows masked to M)
    qw_ref,  # u8[K/2, bn]
    s_ref,  # [K/g, bn]
    z_ref,  # [K/g, bn]
    o_ref,  # [M, bn]  x's dtype; f32 partial sums of split c when split_k > 1 (split axis squeezed)
    *,
    block_m: int,
    block_k: int,
    sub_k: int,
    group_size: int,
    num_steps: int,
    split_k: int,
):
    m_rows = x_ref.shape[0]
    m0 = pl.program_id(0) * block_m
    rows_valid = m0 + jnp.arange(block_m, dtype=jnp.int32) < m_rows  # bool[bm]
    lo, hi = split_steps(num_steps, pl.program_id(2), split_k)
    half = sub_k // 2
    bias = CODE_BIAS.get(jnp.dtype(x_ref.dtype).name, 0.0)

    def body(step, acc):  # acc: f32[bm, bn]
        for j in range(block_k // sub_k):
            k0 = pl.multiple_of(step * block_k + j * sub_k, sub_k)
            x_tile = x_ref.at[pl.ds(m0, block_m), pl.ds(k0, sub_k)]  # one indexer: interpret mode pads it
            x = plgpu.load(x_tile, mask=rows_valid[:, None], other=0.0)  # [bm, sub_k]
            x_even, x_odd = jnp.unstack(x.reshape(block_m, half, 2), axis=-1)  # [bm, sub_k/2] each
            kp0 = pl.multiple_of(step * (block_k // 2) + j * half, half)  # packed row of input k0
            packed = qw_ref[pl.ds(kp0, half), :]  # u8[sub_k/2, bn]
            q_lo = _codes_as(packed & 0xF, x.dtype)  # rows k0, k0 + 2, ... of the dense tile, + bias
            q_hi = _codes_as(packed >> 4, x.dtype)  # rows k0 + 1, k0 + 3, ...
            # HIGHEST: f32 operands in IEEE f32, not TF32 (Triton's default); bf16/f16 are unaffected.
            part = plgpu.dot(x_even, q_lo, precision=HIGHEST) + plgpu.dot(x_odd, q_hi, precision=HIGHEST)
            group = k0 // group_size
            s = s_ref[pl.ds(group, 1), :].astype(jnp.float32)  # f32[1, bn]
            z = z_ref[pl.ds(group, 1), :].astype(jnp.float32)  # f32[1, bn]
            x_sum = jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)  # f32[bm, 1]
            acc = acc + part * s - x_sum * ((z + bias) * s)  # the codes' bias goes with the zero
        return acc

    acc = lax.fori_loop(lo, hi, body, jnp.zeros((block_m, o_ref.shape[1]), jnp.float32))
    plgpu.store(o_ref.at[pl.ds(m0, block_m), :], acc.astype(o_ref.dtype), mask=rows_valid[:, None])


def _codes_as(codes, dtype):  # u8[r, c] (0..15) -> dtype[r, c]: codes + CODE_BIAS[dtype]
    """4-bit codes as dot operands. bf16 / f16: the code goes into the low mantissa bits of the bias
    (0x4300 = 128.0 in bf16, 0x6400 = 1024.0 in f16), so the operand is bias + code exactly, made with
    integer ops alone; an int-to-float conversion (I2F) per weight issues at a quarter of the ALU rate
    on sm_90 and would bound the kernel below the memory bandwidth. f32: converted (no f32 bias keeps
    the dot exact)."""
    name = jnp.dtype(dtype).name
    if name not in CODE_BIAS:
        return codes.astype(dtype)
    magic = CODE_BIAS_BITS[name]
    return lax.bitcast_convert_type(codes.astype(jnp.uint16) | magic, dtype)


def split_steps(num_steps: int, split, split_k: int):
    """Steps [lo, hi) of split `split` out of split_k: near-equal runs of ceil(num_steps / split_k)
    steps; runs past the end are empty (their programs write zeros). default_config picks split_k with
    no empty run."""
    if split_k == 1:
        return 0, num_steps
    per = -(-num_steps // split_k)
    lo = jnp.minimum(split * per, num_steps)
    return lo, jnp.minimum(lo + per, num_steps)


def without_empty_splits(steps: int, split_k: int) -> int:
    """The fewest splits that give split_steps' runs of the same length as split_k does: none is empty."""
    return -(-steps // -(-steps // split_k))


def _largest_pow2_divisor(x: int, cap: int) -> int:
    p = 1
    while p < cap and x % (2 * p) == 0:
        p *= 2
    return p


def _block_k_fits(block_k: int, k: int, group_size: int) -> bool:
    """A step of block_k inputs tiles K and is made of whole sub-blocks of one group each."""
    sub_k = min(block_k, group_size)
    return (
        k % block_k == 0 and (group_size % block_k == 0 or block_k % group_size == 0) and sub_k >= 2 * MIN_DOT
    )


def default_config(m: int, k: int, n: int, group_size: int) -> dict:
    """Tiles from the shapes alone (decode first: M of 1..256).

    bm: M rounded up to a power of two, 16 (the dot's minimum) to 128. bn: 128 columns (a 128-byte row of
    codes per packed row), 64 when bm = 128 to bound the accumulator's registers. bk: 256 inputs per step
    at small M (16 KB of codes per step and tile), 128 at larger M; the largest power of two up to that
    which tiles K in whole groups. split_k: enough splits of K for TARGET_PROGRAMS programs, as long as the
    float32 partial sums (written and read back) stay under a quarter of the weight bytes
    (8 * split_k * M / K <= 1/4), normalised so that no split is empty.
    """
    bm = min(max(MIN_DOT, next_pow2(m)), 128)
    bn = _largest_pow2_divisor(n, 128 if bm <= 64 else 64)
    bk = 256 if bm <= 32 else 128
    while bk > 2 * MIN_DOT and not _block_k_fits(bk, k, group_size):
        bk //= 2  # 32 always fits: it divides g, which divides K (_check_inputs)
    steps = k // bk
    programs = -(-m // bm) * max(1, n // bn)
    split_k = max(1, -(-TARGET_PROGRAMS // programs))
    split_k = max(1, min(split_k, k // (32 * m), steps))
    split_k = without_empty_splits(steps, split_k)
    return dict(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        split_k=split_k,
        num_warps=4 if bm * bn <= 64 * 128 else 8,
        num_stages=4 if bm <= 32 else 3,
    )


def resolve_config(m: int, k: int, n: int, group_size: int, **knobs) -> dict:
    """default_config with the knobs that are not None put over it, checked against the shapes."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown tuning knobs {sorted(unknown)}; known: {KNOBS}")
    cfg = default_config(m, k, n, group_size)
    cfg.update({name: v for name, v in knobs.items() if v is not None})
    for name, least in (("block_m", MIN_DOT), ("block_n", MIN_DOT), ("block_k", 2 * MIN_DOT)):
        v = cfg[name]
        if not isinstance(v, int) or v < least or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= {least}")
    if n % cfg["block_n"]:
        raise ValueError(f"block_n={cfg['block_n']} must divide N={n} (qweight.shape[1])")
    bk = cfg["block_k"]
    if k % bk:
        raise ValueError(f"block_k={bk} must divide K={k}")
    if not _block_k_fits(bk, k, group_size):
        raise ValueError(
            f"block_k={bk} and group size {group_size}: one must divide the other and min(block_k, group "
            f"size) must be >= {2 * MIN_DOT}"
        )
    check_split_and_launch(cfg, k // bk)
    return cfg


def check_split_and_launch(cfg: dict, steps: int) -> None:
    """split_k in [1, steps] (the K steps of block_k); num_warps and num_stages integers >= 1."""
    if not isinstance(cfg["split_k"], int) or not 1 <= cfg["split_k"] <= steps:
        raise ValueError(f"split_k={cfg['split_k']} must be in [1, K / block_k = {steps}]")
    for name in ("num_warps", "num_stages"):
        if not isinstance(cfg[name], int) or cfg[name] < 1:
            raise ValueError(f"{name}={cfg[name]} must be an integer >= 1")


def _launch(x, qweight, scales, zeros, cfg: dict, *, group_size: int, interpret):
    """One pallas_call over the (M, N, split) grid; returns [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    bm, bn, bk, split_k = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    grid = (pl.cdiv(m, bm), n // bn, split_k)
    in_specs = [
        pl.BlockSpec((m, k), lambda i, j, c: (0, 0)),
        pl.BlockSpec((k // 2, bn), lambda i, j, c: (0, j)),
        pl.BlockSpec((scales.shape[0], bn), lambda i, j, c: (0, j)),
        pl.BlockSpec((zeros.shape[0], bn), lambda i, j, c: (0, j)),
    ]
    kernel = functools.partial(
        _w4a16_kernel,
        block_m=bm,
        block_k=bk,
        sub_k=min(bk, group_size),
        group_size=group_size,
        num_steps=k // bk,
        split_k=split_k,
    )
    name = f"w4a16_matmul_bm{bm}_bn{bn}_bk{bk}_sk{split_k}"
    return split_k_call(kernel, (x, qweight, scales, zeros), in_specs, grid, lambda i, j, c: (c, j), bn, cfg,
                        name, interpret)  # fmt: skip


def split_k_call(
    kernel, operands, in_specs, grid, split_and_column, bn: int, cfg: dict, name: str, interpret
):
    """The pallas_call of a W4A16 kernel whose programs each write a [M, bn] block of y = x @ w: with
    split_k 1 straight into y (x's dtype), else as float32 partials [split_k, M, N] that one XLA reduction
    adds. `split_and_column(*program ids) -> (split, column block)`."""
    x, qweight = operands[0], operands[1]
    m, n, split_k = x.shape[0], qweight.shape[1], cfg["split_k"]
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((m, bn), lambda *ids: (0, split_and_column(*ids)[1]))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)

        def partial_block(*ids):
            split, column = split_and_column(*ids)
            return split, 0, column

        out_spec = pl.BlockSpec((None, m, bn), partial_block)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name=name,
    )(*operands)
    if split_k == 1:
        return out
    return jnp.sum(out, axis=0).astype(x.dtype)


def _check_inputs(x, qweight, scales, zeros) -> int:
    """The layout contract (int4_reference.py); returns the group size."""
    if x.ndim != 2 or jnp.dtype(x.dtype).name not in DTYPE_NAMES:
        raise ValueError(f"x must be [M, K] in one of {DTYPE_NAMES}, got {x.dtype}{list(x.shape)}")
    m, k = x.shape
    if qweight.dtype != jnp.uint8 or qweight.ndim != 2 or 2 * qweight.shape[0] != k:
        raise ValueError(
            f"qweight must be u8[K/2, N] with K={k} (x.shape[1]), got {qweight.dtype}{list(qweight.shape)}"
        )
    n = qweight.shape[1]
    for name, a in (("scales", scales), ("zeros", zeros)):
        if a.ndim != 2 or a.shape[1] != n or not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be float [K/g, N={n}], got {a.dtype}{list(a.shape)}")
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros {list(zeros.shape)} must have the shape of scales {list(scales.shape)}")
    g = group_size_of(qweight, scales)
    if g % (2 * MIN_DOT):
        raise ValueError(f"group size K/scales.shape[0] = {g} must be a multiple of {2 * MIN_DOT}")
    if n % MIN_DOT:
        raise ValueError(f"N={n} (qweight.shape[1]) must be a multiple of {MIN_DOT}")
    return g


@functools.partial(jax.jit, static_argnames=("interpret", *KNOBS))
def w4a16_matmul(
    x,  # [M, K]  bf16 / f16 / f32
    qweight,  # u8[K/2, N]
    scales,  # [K/g, N]  float
    zeros,  # [K/g, N]  float
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):  # -> [M, N] in x's dtype
    """x @ w with w = (q - zeros) * scales in the canonical int4 layout, accumulated in float32.

    Same result as ref_w4a16_matmul up to float32 summation order and the final rounding to x's dtype.
    Knobs left as None take default_config's choice; the rest are checked (resolve_config).
    """
    g = _check_inputs(x, qweight, scales, zeros)
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    cfg = resolve_config(
        m, k, n, g, block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_stages is None and x.dtype.itemsize == 4:
        # float32 x tiles are twice bf16's: one stage fewer keeps the pipeline within Hopper's 227 KiB
        # of shared memory (3 stages of a 128-row f32 tile asked for 232 KiB on an H100)
        cfg["num_stages"] = max(2, cfg["num_stages"] - 1)
    return _launch(x, qweight, scales, zeros, cfg, group_size=g, interpret=interpret)
