"""Grouped GEMM for mixture-of-experts as a Pallas kernel for NVIDIA GPUs (Triton lowering):
out[j] = rows[j] @ weights[g(j)], where the rows come sorted by group and group g owns the next
group_sizes[g] of them (layers/moe.py: rows sorted by expert, weights the experts' stacked projections).

Why: XLA's default GPU lowering of `jax.lax.ragged_dot` multiplies every row by every group's weights
and masks the result: an f32[M, E, N] temporary, 24 GiB for Qwen3-30B-A3B's gate|up at 32,768 routed
rows, which does not fit beside the model on one H100. JAX's own Pallas lowering of ragged_dot
(`jax_ragged_dot_use_gpu_pallas_triton_lowering`) imports a module the 0.11.2 wheel lacks. Here each
program multiplies one tile of rows by the one expert they belong to, so the FLOPs are those of the
routed rows and each expert's weights are read only by the tiles that use it (at decode, the few
experts the batch routes to; the others are never read).

Data flow of one call (M rows, K inputs, N outputs, E groups; tiles bm, bn, bk):
  1. `group_metadata` (XLA, a few small ops): the rows of group g are [start_g, end_g); the row tiles
     [t bm, (t + 1) bm) it touches are first_g..last_g. A work item is one (tile, group) pair; a tile
     that holds the end of one group and the start of the next is two items, each writing only its own
     rows. Items are numbered group after group; there are at most cdiv(M, bm) + E - 1 of them, so the
     grid has cdiv(M, bm) + E items (a static size) and the items past the last real one are marked -1.
  2. Grid (items, N / bn). Program (w, j) reads its item's group g and tile t (scalar loads), masks
     the rows outside [start_g, end_g), and accumulates x[rows, k-block] @ weights[g, k-block, bn cols]
     over the K / bk steps in float32; it stores its rows only (masked), so the items sharing a tile
     write disjoint rows. Items marked -1 do nothing.
  3. Rows past sum(group_sizes) belong to no group and are set to zero after the call (ragged_dot's
     contract), as are rows no item wrote.

Constraints (ValueError on violation): rows [M, K] and weights [E, K, N] of the same float dtype
(bfloat16, float16 or float32); K and N multiples of 16 (Triton's least dot operand). Tiles are powers
of two: bn the largest dividing N up to 128, bk the largest dividing K up to 64, bm from the average
rows per group (16 to 64: decode routes a row or two to each expert, prefill hundreds).

Testing: in interpret mode on the CPU, plus its Triton IR for an H100 compiled for sm_90 there
(tests/kernels/test_grouped_matmul.py); `--gpu` runs the same cases compiled on a GPU, and
`python -m benchmarks.moe_grouped_gemm` times it beside ragged_dot and a dense einsum (results and figures:
docs/performance.md, "Mixture of experts").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.ragged_batch import next_pow2, owner

__all__ = ["DTYPES", "default_tiles", "group_metadata", "grouped_matmul", "serves"]

DTYPES = ("bfloat16", "float16", "float32")
MIN_DOT = 16  # Triton's least dot operand dimension
HIGHEST = lax.Precision.HIGHEST  # f32 operands in IEEE f32, not TF32; bf16/f16 are unaffected


def _largest_pow2_divisor(x: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and x % (d * 2) == 0:
        d *= 2
    return d


def default_tiles(m: int, k: int, n: int, num_groups: int) -> dict:
    """Tiles for M rows in num_groups groups: bm near the average rows per group (a tile of a group's
    rows wastes the rest of itself), bn and bk the largest powers of two dividing N and K up to 128 and
    64."""
    per_group = -(-max(m, 1) // max(num_groups, 1))
    return {
        "block_m": min(64, max(MIN_DOT, next_pow2(per_group))),
        "block_n": _largest_pow2_divisor(n, 128),
        "block_k": _largest_pow2_divisor(k, 64),
        "num_warps": 4,
        "num_stages": 3,
    }


def group_metadata(group_sizes: jax.Array, num_rows: int, block_m: int):
    """(item_group i32[W], item_tile i32[W], starts i32[E], ends i32[E]) for W = cdiv(num_rows, block_m)
    + E work items (module docstring, step 1); item_group is -1 past the last real item."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_m
    last = (ends - 1) // block_m
    count = jnp.where(sizes > 0, last - first + 1, 0)  # tiles each group touches
    cum = jnp.cumsum(count)
    offset = cum - count  # the group's first item
    w = pl.cdiv(num_rows, block_m) + e
    items = jnp.arange(w, dtype=jnp.int32)
    group = jnp.minimum(owner(cum, items), e - 1)  # (not searchsorted: ragged_batch.owner says why)
    valid = items < cum[-1]
    tile = first[group] + items - offset[group]
    return jnp.where(valid, group, -1), jnp.where(valid, tile, 0), starts, ends


def _kernel(
    item_group_ref,  # i32[W]
    item_tile_ref,  # i32[W]
    starts_ref,  # i32[E]
    ends_ref,  # i32[E]
    x_ref,  # [M, K]
    w_ref,  # [E, K, bn]: every expert's columns of this program's N block
    o_ref,  # f32[M, bn]
    *,
    block_m: int,
    block_k: int,
    num_steps: int,
):
    item = pl.program_id(0)
    group = item_group_ref[item]

    @pl.when(group >= 0)
    def _():
        m0 = item_tile_ref[item] * block_m
        rows = m0 + jnp.arange(block_m, dtype=jnp.int32)
        mine = (rows >= starts_ref[group]) & (rows < ends_ref[group])  # bool[bm]

        def body(step, acc):  # acc: f32[bm, bn]
            k0 = pl.multiple_of(step * block_k, block_k)
            x_tile = x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)]  # one indexer: interpret mode pads it
            x = plgpu.load(x_tile, mask=mine[:, None], other=0.0)  # [bm, bk]
            w = w_ref[group, pl.ds(k0, block_k), :]  # [bk, bn]
            return acc + plgpu.dot(x, w, precision=HIGHEST)

        acc = lax.fori_loop(0, num_steps, body, jnp.zeros((block_m, o_ref.shape[1]), jnp.float32))
        plgpu.store(o_ref.at[pl.ds(m0, block_m), :], acc, mask=mine[:, None])


def serves(rows, weights) -> bool:
    """Whether the kernel takes these operands (same float dtype of DTYPES; K and N multiples of 16)."""
    k, n = weights.shape[-2:]
    return (
        rows.dtype == weights.dtype
        and jnp.dtype(rows.dtype).name in DTYPES
        and not (k % MIN_DOT or n % MIN_DOT)
    )


def _check(rows, weights, group_sizes) -> None:
    if rows.ndim != 2 or weights.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped_matmul takes rows [M, K], weights [E, K, N] and group_sizes [E]; got {rows.shape}, "
            f"{weights.shape} and {group_sizes.shape}"
        )
    (_, k), (e, k_w, n) = rows.shape, weights.shape
    if k_w != k or group_sizes.shape[0] != e:
        raise ValueError(
            f"grouped_matmul: rows {rows.shape}, weights {weights.shape} and group_sizes "
            f"{group_sizes.shape} disagree (rows' K must be the weights' K; one size per group)"
        )
    if rows.dtype != weights.dtype or jnp.dtype(rows.dtype).name not in DTYPES:
        raise ValueError(
            f"grouped_matmul: rows {rows.dtype} and weights {weights.dtype} must be one of {', '.join(DTYPES)}"
        )
    if k % MIN_DOT or n % MIN_DOT:
        raise ValueError(f"grouped_matmul: K={k} and N={n} must be multiples of {MIN_DOT}")


def grouped_matmul(
    rows: jax.Array,  # [M, K] sorted by group
    weights: jax.Array,  # [E, K, N]
    group_sizes: jax.Array,  # i32[E], summing to at most M
    interpret: bool = False,
) -> jax.Array:  # f32[M, N]; rows past sum(group_sizes) are zero
    """rows[j] . weights[group of j] for every row, accumulated in float32 (module docstring)."""
    _check(rows, weights, group_sizes)
    (m, k), (e, _, n) = rows.shape, weights.shape
    if m == 0:
        return jnp.zeros((0, n), jnp.float32)
    cfg = default_tiles(m, k, n, e)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    item_group, item_tile, starts, ends = group_metadata(group_sizes, m, bm)
    w = item_group.shape[0]
    whole = lambda *shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=bm, block_k=bk, num_steps=k // bk),
        grid=(w, n // bn),
        in_specs=[
            whole(w),
            whole(w),
            whole(e),
            whole(e),
            whole(m, k),
            pl.BlockSpec((e, k, bn), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((m, bn), lambda i, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name=f"grouped_matmul_bm{bm}_bn{bn}_bk{bk}",
    )(item_group, item_tile, starts, ends, rows, weights)
    # Rows of no group (past the sizes' sum) were never written.
    return jnp.where((jnp.arange(m) < ends[-1])[:, None], out, 0.0)
