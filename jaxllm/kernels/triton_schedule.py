"""Work schedule of the ragged paged-attention kernel: which query rows each grid program owns.

The flattened batch is cut into work items of at most `block_q` query rows, each inside ONE sequence,
so that one program sees one sequence's context. Rows past cu_q_lens[num_seqs] form one extra
pseudo-sequence of context length 0: its programs write zeros, so padding rows come out as zeros
without a second pass over the output. The item count is bounded statically:
  sum_s cdiv(q_len_s, block_q) + cdiv(pad, block_q) <= cdiv(T, block_q) + S + 1
Items past the real count are empty (q1 == q0, kv_len == 0): their programs load and store nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.ragged_batch import owner


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    seq: jax.Array  # i32[W] block-table row of the item (0 for padding / empty items)
    q0: jax.Array  # i32[W] first query row
    q1: jax.Array  # i32[W] one past the last query row (q1 == q0: empty item)
    kv_len: jax.Array  # i32[W] context length of the item's sequence (0: nothing to attend)
    pos0: jax.Array  # i32[W] position of row q0 in its sequence (kv_len - q_len + offset)


def max_work_items(num_tokens: int, num_seq_slots: int, block_q: int) -> int:
    return -(-num_tokens // block_q) + num_seq_slots + 1


def build_work_items(
    md: PagedAttentionMetadata,
    *,
    num_tokens: int,
    block_q: int,
    select: str = "all",
    num_items: int | None = None,
    max_q_len: int | None = None,
) -> WorkItems:
    """`select`: "all" rows; "decode" only sequences of one query row (no padding items: at most one
    item per sequence, so num_items = S + 1 is enough); "prefill" the others and the padding rows.
    `max_q_len`: sequences of that many query rows or more are left out too (another kernel takes them).
    Rows of unselected sequences get no item: a program never writes them."""
    if select not in ("all", "decode", "prefill"):
        raise ValueError(f"select={select!r} must be 'all', 'decode' or 'prefill'")
    kv_lens, cu_q_lens, num_seqs = md.kv_lens, md.cu_q_lens, md.num_seqs
    s = kv_lens.shape[0]
    w = max_work_items(num_tokens, s, block_q) if num_items is None else num_items
    n = jnp.clip(num_seqs[0], 0, s)
    sidx = jnp.arange(s, dtype=jnp.int32)
    real = sidx < n
    q_end = cu_q_lens[n]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    if select == "decode":
        real &= q_lens == 1
    elif select == "prefill":
        real &= q_lens != 1
    if max_q_len is not None:
        real &= q_lens < max_q_len
    pad_len = (num_tokens - q_end)[None] if select != "decode" else jnp.zeros((1,), jnp.int32)
    lens = jnp.concatenate([jnp.where(real, q_lens, 0), pad_len])
    lens = jnp.maximum(lens, 0)  # [S + 1]
    starts = jnp.concatenate([cu_q_lens[:-1], q_end[None]])  # [S + 1]
    kvl = jnp.concatenate([jnp.where(real, kv_lens, 0), jnp.zeros((1,), jnp.int32)])  # [S + 1]
    n_items = (lens + block_q - 1) // block_q
    ends = jnp.cumsum(n_items)
    begins = ends - n_items
    widx = jnp.arange(w, dtype=jnp.int32)
    valid = widx < ends[-1]
    sq = jnp.minimum(owner(ends, widx), s)  # the sequence of item w
    j = widx - begins[sq]
    q0 = starts[sq] + j * block_q
    q1 = jnp.where(valid, jnp.minimum(q0 + block_q, starts[sq] + lens[sq]), q0)
    kv = jnp.where(valid, kvl[sq], 0)
    pos0 = kv - lens[sq] + j * block_q
    seq = jnp.where(sq < s, sq, 0)
    i32 = lambda x: x.astype(jnp.int32)
    return WorkItems(seq=i32(seq), q0=i32(q0), q1=i32(q1), kv_len=i32(kv), pos0=i32(pos0))


def has_keys(items: WorkItems) -> jax.Array:
    """bool[W]: the items with rows and keys to read (empty and padding items have neither)."""
    return (items.kv_len > 0) & (items.q1 > items.q0)


def active_splits(
    items: WorkItems, *, hkv: int, k_splits: int, target: int, block_k: int, slots: int | None = None
) -> jax.Array:
    """i32[1]: how many of a launch's k_splits context splits its programs use, chosen on the device.

    The grid's split count is static, fixed by the step's bucket, but the number of work items that have
    keys to read is known only at run time: one long sequence in a bucket of 8 slots. Splits are doubled
    until hkv x (items with keys) x splits reaches `target` programs, as default_config does for a full
    bucket, then capped at k_splits, at the longest item's key steps of `block_k` keys (more splits than
    steps would only be empty) and at the `slots` program slots a KV head has over the items with keys
    (deal_programs; slots >= the item count, so each item gets at least one). target 0: all k_splits."""
    if k_splits == 1 or target == 0:
        return jnp.full((1,), k_splits, jnp.int32)
    busy_items = has_keys(items)
    busy = jnp.maximum(jnp.sum(busy_items), 1)
    want = (target + hkv * busy - 1) // (hkv * busy)
    splits = jnp.int32(1)
    for _ in range(max(0, (k_splits - 1).bit_length())):  # the next power of two >= want, up to k_splits
        splits = jnp.where(splits < want, splits * 2, splits)
    steps = (jnp.max(jnp.where(busy_items, items.kv_len, 0)) + block_k - 1) // block_k
    splits = jnp.minimum(splits, steps)
    if slots is not None:
        splits = jnp.minimum(splits, slots // busy)
    return jnp.clip(splits, 1, k_splits).astype(jnp.int32)[None]


def deal_programs(items: WorkItems, used: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """(item, split), each i32[slots]: what program slot n of a KV head does in a split launch. The items
    with keys, in order, get `used` consecutive slots each (their splits 0 .. used - 1); slots past
    those get item -1 and do nothing. active_splits keeps (items with keys) x used <= slots."""
    w = items.kv_len.shape[0]
    busy_items = has_keys(items)
    rank = jnp.cumsum(busy_items.astype(jnp.int32)) - 1
    busy_ids = (
        jnp.zeros((w,), jnp.int32)
        .at[jnp.where(busy_items, rank, w)]
        .set(jnp.arange(w, dtype=jnp.int32), mode="drop")
    )
    n = jnp.arange(slots, dtype=jnp.int32)
    per = used[0]
    r = n // per
    item = jnp.where(r < jnp.sum(busy_items), busy_ids[jnp.minimum(r, w - 1)], -1)
    return item.astype(jnp.int32), (n % per).astype(jnp.int32)
