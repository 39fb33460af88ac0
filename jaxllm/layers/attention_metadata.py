"""The fixed-shape description of one engine step that every attention layer reads.

Built on the host by the runner (runner/input_batch.py), padded to buckets, passed into the jitted step.
  T: padded token count   S: padded sequence count   B: padded pages per sequence
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # i32[T] position of each token in its sequence (0 for padding)
    slot_mapping: jax.Array  # i32[T] page * page_size + offset where the token's K/V go; -1: padding
    block_tables: jax.Array  # i32[S, B] pages of each sequence (unused entries: any valid page id)
    kv_lens: jax.Array  # i32[S] context length after this step (0 for padding sequences)
    cu_q_lens: jax.Array  # i32[S + 1] query rows of sequence s are cu_q_lens[s]:cu_q_lens[s+1]
    num_seqs: jax.Array  # i32[1] real sequences in the batch


# KV cache of one layer: (k_pages, v_pages), each [Hkv, P, PS, D].
KVCache = tuple[jax.Array, jax.Array]
