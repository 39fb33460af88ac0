"""One sequence of `t` tokens as a model step's inputs, for tests that call a module directly."""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.layers.attention_metadata import AttentionMetadata


def one_sequence(arch, t: int = 5):
    """(input_ids i32[t], per-layer zero KV caches of 2 pages x 4 slots, AttentionMetadata): one prefill
    of t <= 8 tokens (ids 3, 4, ...) written to slots 0..t-1."""
    kv = jnp.zeros((arch.num_kv_heads, 2, 4, arch.head_dim), jnp.float32)
    md = AttentionMetadata(
        positions=jnp.arange(t, dtype=jnp.int32), slot_mapping=jnp.arange(t, dtype=jnp.int32),
        block_tables=jnp.array([[0, 1]], jnp.int32), kv_lens=jnp.array([t], jnp.int32),
        cu_q_lens=jnp.array([0, t], jnp.int32), num_seqs=jnp.array([1], jnp.int32),
    )  # fmt: skip
    return jnp.arange(3, 3 + t, dtype=jnp.int32), [(kv, kv)] * arch.num_layers, md
