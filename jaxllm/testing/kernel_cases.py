"""Random ragged paged-attention problems, shared by the kernel tests and the kernel benchmarks.

A problem is built to catch what kernels get wrong: block tables are a random permutation of the pool
(no kernel may assume contiguous pages), every unused page and the tail of every last page hold NaN (a
kernel that multiplies instead of selecting leaks it), a few padding rows follow the real ones (they
must come out zero) and a padding sequence slot follows the real sequences. assert_matches_reference
checks all of that against the plain-jnp reference's output.

With `kv_dtype` an fp8 type the pages are stored as an FP8 KV cache holds them (kv_quant.quantize_kv with
the problem's k_scale / v_scale; NaN stays NaN there), and every op is given the scales (`scales()`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.kv_quant import is_fp8, quantize_kv
from jaxllm.kernels.metadata import PagedAttentionMetadata

# Relative L2 error allowed against the float32 reference, by input dtype.
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}


def tolerance(dtype) -> float:
    return TOLERANCE[jnp.dtype(dtype).name]


# Batch shapes by mode: (q_lens, kv_lens). Lengths 1, 3, 513, 1023 do not line up with pages.
MODES = {
    "decode": ([1, 1, 1, 1], [1, 3, 513, 1023]),
    "prefill": ([3, 40], [3, 40]),
    "mixed": ([1, 37, 1, 3], [1023, 37, 513, 40]),
    "chunked": ([64], [513]),
}


@dataclass(frozen=True)
class Problem:
    q: jnp.ndarray  # [T, Hq, D]
    k_pages: jnp.ndarray  # [Hkv, P, PS, D]
    v_pages: jnp.ndarray  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata  # S sequence slots, the last pad_seqs of them padding
    num_rows: int  # real query rows; rows past it are padding
    k_scale: float = 1.0  # fp8 pages hold k / k_scale
    v_scale: float = 1.0

    def args(self):
        """(q, k_pages, v_pages, md): the positional arguments of every attention op."""
        return self.q, self.k_pages, self.v_pages, self.md

    def scales(self) -> dict:
        """The keyword arguments that tell an op the fp8 pages' scales ({} for pages of q's dtype)."""
        if not is_fp8(self.k_pages.dtype):
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def make_problem(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    page_size: int,
    dtype,
    seed: int = 0,
    pad_rows: int = 3,
    pad_seqs: int = 1,
    extra_table_pages: int = 1,
    kv_dtype=None,
    kv_scales: tuple[float, float] = (1 / 16, 1 / 32),
) -> Problem:
    """Sequence i has q_lens[i] query rows (its last ones) and kv_lens[i] tokens of context.
    `extra_table_pages`: block-table columns past the longest sequence's pages (the engine's tables are
    max_model_len / page_size wide, most of them unused). `kv_dtype`: the pages' dtype (None: `dtype`);
    an fp8 one stores them with `kv_scales` (k_scale, v_scale): powers of two by default, which put the
    standard-normal values mid-range of e4m3 (|k| / k_scale up to about 80, of 448)."""
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    s = n + pad_seqs
    pages_needed = [-(-k // page_size) for k in kv_lens]
    b = max(pages_needed) + extra_table_pages
    p = sum(pages_needed) + 5
    perm = rng.permutation(p)
    bt = np.zeros((s, b), np.int32)  # unused entries: page 0, which may be some sequence's page
    k = rng.standard_normal((hkv, p, page_size, d)).astype(np.float32)
    v = rng.standard_normal((hkv, p, page_size, d)).astype(np.float32)
    used = np.zeros((p, page_size), bool)
    at = 0
    for i, (kl, np_) in enumerate(zip(kv_lens, pages_needed, strict=True)):
        bt[i, :np_] = perm[at : at + np_]
        at += np_
        for j in range(np_):
            used[bt[i, j], : min(page_size, kl - j * page_size)] = True
    k[:, ~used] = np.nan
    v[:, ~used] = np.nan
    cu = np.zeros(s + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kvl = np.zeros(s, np.int32)
    kvl[:n] = kv_lens
    t = int(cu[n]) + pad_rows
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    md = PagedAttentionMetadata(
        kv_lens=jnp.asarray(kvl),
        block_tables=jnp.asarray(bt),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([n], jnp.int32),
    )
    if kv_dtype is not None and is_fp8(kv_dtype):
        k_scale, v_scale = kv_scales
        return Problem(
            q=jnp.asarray(q, dtype),
            k_pages=quantize_kv(jnp.asarray(k), k_scale, kv_dtype),
            v_pages=quantize_kv(jnp.asarray(v), v_scale, kv_dtype),
            md=md,
            num_rows=int(cu[n]),
            k_scale=k_scale,
            v_scale=v_scale,
        )
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return Problem(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k, kv_dtype),
        v_pages=jnp.asarray(v, kv_dtype),
        md=md,
        num_rows=int(cu[n]),
    )


def rel_err(out, ref) -> float:
    """Relative L2 error of out against ref, in float32."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_matches_reference(out, ref, prob: Problem, tol: float) -> None:
    """A kernel's output against the reference: same shape, finite, padding rows zero, and the real rows
    within `tol` relative error."""
    out = np.asarray(out, np.float32)
    assert out.shape == prob.q.shape
    assert np.isfinite(out).all(), "NaN/inf leaked into the output"
    assert (out[prob.num_rows :] == 0).all(), "padding rows must be zero"
    err = rel_err(out[: prob.num_rows], ref[: prob.num_rows])
    assert err < tol, f"relative error {err:.3g}"
