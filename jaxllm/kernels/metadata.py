"""What every attention op of this package is told about the batch: one pytree, and the checks they share.

A step's query rows form one flattened (ragged) batch of T rows: sequence s owns rows
cu_q_lens[s]:cu_q_lens[s + 1] and has kv_lens[s] tokens of context in the pages block_tables[s] (this
step's K/V already written). The batch is padded to static shapes: sequence slots past num_seqs[0] and
rows past cu_q_lens[num_seqs[0]] are padding. PagedAttentionMetadata carries these four arrays as one
argument, so the ops, the reference and the dispatcher share one signature
`(q, k_pages, v_pages, md, *, sm_scale, ...)`, and a jitted caller passes them as one pytree.

check_inputs holds the contract's shape and dtype rules, so every op rejects the same bad input with
the same message (a ValueError naming the argument or field).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.kernels.kv_quant import is_fp8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
    kv_lens: jax.Array  # i32[S] context length of each sequence after this step (0 for padding slots)
    block_tables: jax.Array  # i32[S, B] page ids of each sequence's context, in order
    cu_q_lens: jax.Array  # i32[S + 1] query rows of sequence s are cu_q_lens[s]:cu_q_lens[s + 1]
    num_seqs: jax.Array  # i32[1] real sequences; slots from num_seqs[0] on are padding

    def check(self) -> None:
        """Shapes and dtypes of the fields against each other; a ValueError names the field."""
        bt = self.block_tables
        if bt.ndim != 2 or bt.dtype != jnp.int32:
            raise ValueError(f"block_tables must be i32[S, B], got {bt.dtype}{list(bt.shape)}")
        s = bt.shape[0]
        for name, shape in (("kv_lens", (s,)), ("cu_q_lens", (s + 1,)), ("num_seqs", (1,))):
            x = getattr(self, name)
            if x.shape != shape or x.dtype != jnp.int32:
                raise ValueError(f"{name} must be i32{list(shape)}, got {x.dtype}{list(x.shape)}")


def check_inputs(
    q,  # [T, Hq, D]
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
    *,
    dtypes,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """The contract every attention op checks before tracing its kernel: shapes, dtypes (q one of
    `dtypes`; the pages q's dtype or fp8: kv_quant.py), head dim, page size, the metadata and the
    options."""
    if not isinstance(md, PagedAttentionMetadata):
        raise TypeError(f"md must be a PagedAttentionMetadata, got {type(md).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [Hkv, P, PS, D]; got {k_pages.shape}, {v_pages.shape}"
        )
    _, hq, d = q.shape
    hkv, _, ps, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and k_pages ({dk}) must match")
    if d not in (64, 128, 256):
        raise ValueError(f"head_dim={d} must be one of 64, 128, 256")
    if hq % hkv:
        raise ValueError(f"num q heads {hq} must be a multiple of num kv heads {hkv}")
    if ps < 1 or ps & (ps - 1):
        raise ValueError(f"page_size={ps} must be a power of two")
    if q.dtype not in dtypes:
        names = ", ".join(jnp.dtype(t).name for t in dtypes)
        raise ValueError(f"q dtype must be one of {names}; got {q.dtype}")
    if k_pages.dtype != v_pages.dtype or not (k_pages.dtype == q.dtype or is_fp8(k_pages.dtype)):
        raise ValueError(
            f"k_pages/v_pages dtype must be q's ({q.dtype}) or an fp8 one (float8_e4m3fn, float8_e5m2) for "
            f"both; got {k_pages.dtype}, {v_pages.dtype}"
        )
    md.check()
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 or None")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"{soft_cap=} must be > 0 or None")
