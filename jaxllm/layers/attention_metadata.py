"""The fixed-shape description of one engine step that every attention layer reads.

Built on the host by the runner (runner/input_batch.py), padded to buckets, passed into the jitted step.
The model reads `positions` (rotary embeddings); the attention layer writes the step's K/V at
`slot_mapping` and hands the kernels the rest as one jaxllm.kernels PagedAttentionMetadata (`paged`).
  T: padded token count   S: padded sequence count   B: padded pages per sequence
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxllm.kernels.metadata import PagedAttentionMetadata


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # i32[T] position of each token in its sequence (0 for padding)
    slot_mapping: jax.Array  # i32[T] page * page_size + offset where the token's K/V go; -1: padding
    block_tables: jax.Array  # i32[S, B] pages of each sequence (unused entries: any valid page id)
    kv_lens: jax.Array  # i32[S] context length after this step (0 for padding sequences)
    cu_q_lens: jax.Array  # i32[S + 1] query rows of sequence s are cu_q_lens[s]:cu_q_lens[s+1]
    num_seqs: jax.Array  # i32[1] real sequences in the batch

    @property
    def paged(self) -> PagedAttentionMetadata:
        """The fields the attention kernels read, as the one pytree they take (made while tracing: no
        copy, no device work)."""
        return PagedAttentionMetadata(
            kv_lens=self.kv_lens,
            block_tables=self.block_tables,
            cu_q_lens=self.cu_q_lens,
            num_seqs=self.num_seqs,
        )


# KV cache of one layer: (k_pages, v_pages), each [Hkv, P, PS, D].
KVCache = tuple[jax.Array, jax.Array]
