"""A small paged-KV driver for model tests: prefill a batch of prompts in one ragged step, then decode.

Pages are handed out in a shuffled order so that a model that ignored the block tables would fail.
Shapes are fixed per runner (T_prefill, S, B), so each model compiles two step functions at most.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention_metadata import AttentionMetadata


class PagedRunner:
    def __init__(self, loaded, max_seqs=4, block_size=4, max_len=64, prefill_tokens=64, seed=0):
        self.module, self.params, arch = loaded.module, loaded.params, loaded.arch
        self.s, self.ps = max_seqs, block_size
        self.b = -(-max_len // block_size)
        self.t_prefill = prefill_tokens
        num_blocks = self.s * self.b + 1
        perm = np.random.default_rng(seed).permutation(num_blocks)
        self.block_tables = perm[: self.s * self.b].reshape(self.s, self.b).astype(np.int32)
        dtype = jax.tree.leaves(self.params)[0].dtype
        # NaN in every page: a read of an unwritten slot would poison the logits.
        shape = (arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
        self.kv = [
            (jnp.full(shape, jnp.nan, dtype), jnp.full(shape, jnp.nan, dtype)) for _ in range(arch.num_layers)
        ]
        self.lens = [0] * self.s

        def step(params, ids, kv, md):
            hidden, kv = self.module.apply({"params": params}, ids, kv, md)
            logits = self.module.apply({"params": params}, hidden, method="compute_logits")
            return logits, kv

        self._step = jax.jit(step, donate_argnums=(2,))

    def _run(self, chunks: list[list[int]], t_pad: int) -> list[np.ndarray]:
        """chunks[s]: new tokens of sequence s (empty: sequence idle). Returns logits rows per sequence."""
        ids, pos, slots, cu = [], [], [], [0]
        kv_lens = np.zeros(self.s, np.int32)
        active = [i for i, c in enumerate(chunks) if c]
        for i in active:
            start = self.lens[i]
            for j, tok in enumerate(chunks[i]):
                p = start + j
                ids.append(tok)
                pos.append(p)
                slots.append(self.block_tables[i, p // self.ps] * self.ps + p % self.ps)
            cu.append(len(ids))
        n = len(active)
        # the block table row of a batch slot must follow the slot's sequence
        bt = np.zeros((self.s, self.b), np.int32)
        for k, i in enumerate(active):
            bt[k] = self.block_tables[i]
            kv_lens[k] = self.lens[i] + len(chunks[i])
        t = len(ids)
        assert t <= t_pad
        pad = t_pad - t
        md = AttentionMetadata(
            positions=jnp.asarray(pos + [0] * pad, jnp.int32),
            slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
            block_tables=jnp.asarray(bt),
            kv_lens=jnp.asarray(kv_lens),
            cu_q_lens=jnp.asarray(cu + [t] * (self.s - n), jnp.int32),
            num_seqs=jnp.asarray([n], jnp.int32),
        )
        logits, self.kv = self._step(self.params, jnp.asarray(ids + [0] * pad, jnp.int32), self.kv, md)
        logits = np.asarray(logits)
        out = []
        for k, i in enumerate(active):
            out.append(logits[cu[k] : cu[k + 1]])
            self.lens[i] += len(chunks[i])
        return out

    def prefill(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """f32[len(prompt), V] logits of every prompt position."""
        return self._run(list(prompts) + [[]] * (self.s - len(prompts)), self.t_prefill)

    def extend(self, chunks: list[list[int]]) -> list[np.ndarray]:
        """One step that gives sequence s the tokens chunks[s] after those it has (a prefill chunk):
        f32[len(chunks[s]), V] logits per sequence."""
        return self._run(list(chunks) + [[]] * (self.s - len(chunks)), self.t_prefill)

    def greedy(self, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        last = [lg[-1] for lg in self.prefill(prompts)]
        out = [[int(np.argmax(lg))] for lg in last]
        for _ in range(num_tokens - 1):
            rows = self._run([[o[-1]] for o in out] + [[]] * (self.s - len(out)), self.s)
            for o, lg in zip(out, rows, strict=True):
                o.append(int(np.argmax(lg[-1])))
        return out
