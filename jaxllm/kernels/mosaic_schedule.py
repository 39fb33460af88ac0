"""Tiles of the Mosaic GPU prefill kernel and their schedule (mosaic_prefill.py).

MgpuConfig (tile sizes, pipeline depth, warpgroup roles) and its shared-memory budget; `work_items`
cuts the flattened batch into TILE-row items of one sequence, ranked longest causal length first, so
that mosaic_common.unit_schedule's snake order over the persistent CTAs balances their causal work;
`kv_steps` counts the KV blocks a tile visits; `Unit` is what every warpgroup of a CTA reads about its
current (item, q head) unit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.mosaic_common import cdiv, check_ring
from jaxllm.kernels.ragged_batch import owner

COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Static tuning of the kernel. TILE = 2 * block_q query rows per CTA."""

    block_q: int = 64  # query rows per compute warpgroup (wgmma M)
    block_kv: int = 128  # tokens per KV block (block_kv / page_size pages per block)
    stages: int = 2  # KV blocks in flight (shared-memory ring depth)
    schedule_barrier: bool = True  # compute warpgroups take turns on the tensor cores
    longest_first: bool = True  # order work items by causal length, longest first
    # "regs": P V takes P from registers and accumulates into O in place (pl.run_state).
    # "smem": P is staged in shared memory and P V goes to a fresh accumulator added to O: the form
    # interpret mode runs (it models neither register operands nor run_state accumulators).
    pv_mode: str = "regs"
    # Persistent grid: each CTA loops over its share of the (item, q head) units, loading the next
    # unit's Q and K/V while it finishes the current one. Otherwise one CTA per unit.
    persistent: bool = True
    num_ctas: int | None = None  # CTAs of the persistent grid; None: the device's SM count
    q_buffers: int = 2  # 2: the next unit's Q loads during the current unit; 1: saves shared memory
    compute_registers: int = 232
    memory_registers: int = 40

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"block_q={self.block_q} must be 64 (one wgmma M tile per warpgroup)")
        check_ring(self.block_kv, self.stages, self.num_ctas, self.pv_mode)
        if self.q_buffers not in (1, 2):
            raise ValueError(f"q_buffers={self.q_buffers} must be 1 or 2")

    @property
    def tile(self) -> int:
        return COMPUTE_WGS * self.block_q

    def smem_bytes(self, d: int, itemsize: int) -> int:
        p_tile = COMPUTE_WGS * self.block_q * self.block_kv if self.pv_mode == "smem" else 0
        q_tiles = self.q_buffers * COMPUTE_WGS * self.block_q
        return ((q_tiles + 2 * self.stages * self.block_kv) * d + p_tile) * itemsize


def default_config(head_dim: int) -> MgpuConfig:
    """128-token KV blocks 2 deep; at head_dim 256 shared memory allows only 64-token blocks, one Q buffer."""
    if head_dim > 128:
        return MgpuConfig(block_kv=64, q_buffers=1)
    return MgpuConfig()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    table: jax.Array  # i32[4, W]: rows SEQ, TILE, KV_LEN, POS0 (see below)
    q_row: jax.Array | None  # i32[W * TILE] source row in q of each padded row (not aligned), else None
    out_row: jax.Array | None  # i32[T] padded row of each output row (not aligned), else None
    row_valid: jax.Array | None  # bool[T] rows of real sequences (not aligned), else None


# Rows of WorkItems.table: block-table row; tile index (the item's q and output rows are
# [tile * TILE, (tile + 1) * TILE) of the kernel's q/out arrays); kv_len (0: write zeros); position of
# the item's first row in its sequence.
SEQ, TILE, KV_LEN, POS0 = range(4)


def max_padded_items(num_tokens: int, num_seq_slots: int, tile: int, min_q_len: int = 1) -> int:
    """Static bound on the items of the padded layout: each selected sequence adds at most one partial
    tile, and at most num_tokens // min_q_len sequences have min_q_len rows or more."""
    return cdiv(num_tokens, tile) + min(num_seq_slots, num_tokens // max(min_q_len, 1))


def work_items(
    md: PagedAttentionMetadata, *, num_tokens, cfg: MgpuConfig, aligned: bool, min_q_len: int = 1
) -> WorkItems:
    """Work items of TILE query rows of one sequence each.

    aligned: item w is rows [w * TILE, (w + 1) * TILE) of q itself. Otherwise each sequence's chunk
    is padded to whole tiles in a padded copy of q (TMA needs tile rows to start at multiples of 8).
    min_q_len (padded layout only): sequences with fewer query rows get no items and their rows come
    out zero (another kernel takes them); it also bounds the item count, so the padded copy of q stays
    small (max_padded_items).
    """
    if aligned and min_q_len > 1:
        raise ValueError(f"min_q_len={min_q_len} needs the padded layout (aligned=False)")
    tile = cfg.tile
    kv_lens, cu_q_lens = md.kv_lens, md.cu_q_lens
    s = kv_lens.shape[0]
    n = jnp.clip(md.num_seqs[0], 0, s)
    real = jnp.arange(s, dtype=jnp.int32) < n
    starts = cu_q_lens[:-1]
    if min_q_len > 1:
        real &= cu_q_lens[1:] - starts >= min_q_len
    q_lens = jnp.where(real, cu_q_lens[1:] - starts, 0)
    kvl = jnp.where(real, kv_lens, 0)
    q_row = out_row = row_valid = None
    if aligned:
        w = cdiv(num_tokens, tile)
        widx = jnp.arange(w, dtype=jnp.int32)
        row0 = widx * tile
        seq = owner(cu_q_lens[1:], row0)  # the sequence of row0
        valid = (seq < n) & (row0 < cu_q_lens[n])
        seq = jnp.minimum(seq, s - 1)
        kv = jnp.where(valid, kvl[seq], 0)
        pos0 = kv - q_lens[seq] + (row0 - starts[seq])
    else:
        n_items = cdiv(q_lens, tile)
        ends = jnp.cumsum(n_items)
        begins = ends - n_items
        w = max_padded_items(num_tokens, s, tile, min_q_len)
        widx = jnp.arange(w, dtype=jnp.int32)
        seq = jnp.minimum(owner(ends, widx), s - 1)
        valid = widx < ends[-1]
        j = widx - begins[seq]
        kv = jnp.where(valid, kvl[seq], 0)
        pos0 = kv - q_lens[seq] + j * tile
        q_row = jnp.minimum(
            (starts[seq] + j * tile)[:, None] + jnp.arange(tile, dtype=jnp.int32), num_tokens - 1
        )
        q_row = q_row.reshape(w * tile)
        rows = jnp.arange(num_tokens, dtype=jnp.int32)
        rseq = owner(cu_q_lens[1:], rows)
        row_valid = (rseq < n) & (rows < cu_q_lens[n])
        rseq = jnp.minimum(rseq, s - 1)
        row_valid &= real[rseq]
        out_row = jnp.where(row_valid, begins[rseq] * tile + rows - starts[rseq], 0)
    table = jnp.stack([seq, widx, kv, pos0]).astype(jnp.int32)
    if cfg.longest_first:
        # Rank by KV blocks to visit (descending, ties in index order): an O(W^2) compare, no sort.
        work = cdiv(jnp.maximum(jnp.minimum(kv, pos0 + tile), 0), cfg.block_kv)
        before = (work[None, :] > work[:, None]) | (
            (work[None, :] == work[:, None]) & (widx[None, :] < widx[:, None])
        )
        rank = jnp.sum(before, axis=1, dtype=jnp.int32)
        order = jnp.zeros((w,), jnp.int32).at[rank].set(widx)
        table = table[:, order]
    return WorkItems(table=table, q_row=q_row, out_row=out_row, row_valid=row_valid)


def kv_steps(kv_len, pos_first, block_q: int, block_kv: int):
    """(blocks a warpgroup visits, of which the first `full` need no mask) for rows from pos_first."""
    hi = jnp.maximum(jnp.minimum(kv_len, pos_first + block_q), 0)  # one past the last visible key
    n = cdiv(hi, block_kv)
    full = jnp.clip(jnp.maximum(jnp.minimum(pos_first + 1, kv_len), 0) // block_kv, 0, n)
    return n, full


@dataclasses.dataclass(frozen=True)
class Unit:
    """One (work item, q head) pair: what every warpgroup of the CTA reads about it."""

    head: jax.Array
    seq: jax.Array
    row0: jax.Array  # first q/output row: a visible multiple of 8, as TMA into tiled SMEM needs
    kv_len: jax.Array
    pos0: jax.Array
    n0: jax.Array  # KV blocks warpgroup 0 visits
    n_cta: jax.Array  # KV blocks the CTA visits (warpgroup 1 holds the later rows: all of them)
