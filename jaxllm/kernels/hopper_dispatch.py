"""Ragged paged attention on Hopper: each row of the batch goes to the kernel that is fastest for it.

Decode-like batches (at most two rows per sequence) with enough work for the persistent Mosaic decode
kernel (mosaic_decode.py: at least DECODE_MIN_UNITS (row, KV head) units) run there (`_decode_like`):
  - T == S (the engine's decode buckets): every row, chunk rows included, on that kernel; one launch.
  - S < T <= 2 S: the decode rows on that kernel, then the short chunks and the padding rows on the
    Triton kernel's decode-like config, written into the same output in place.
That kernel streams the KV cache without the Triton kernel's per-program pipeline fill and drain, which
pays at large batches. Smaller batches stay on the Triton kernel, whose context splits keep more SMs
busy.

Other batches (one output buffer, written by up to three launches in turn):
  1. Where contexts can reach PREFILL_MIN_CONTEXT tokens, prefill chunks of at least `mosaic_min_q_len`
     query rows (one TILE, 128, by default) go to the Mosaic GPU prefill kernel (mosaic_prefill.py;
     wgmma, per-page TMA, warp-specialised: well above the Triton kernel on long chunks). Every other
     row comes out zero. Only long chunks are taken because that kernel works on whole 128-row tiles
     of one sequence gathered into a padded copy of q: a short chunk would cost a whole tile of gather
     and tensor work, and with at most T / 128 such chunks the padded copy stays within 2 T rows
     (mosaic_schedule.max_padded_items).
  2. Decode rows (sequences of one query row) run through the Triton kernel's decode configuration,
     written into that output in place (`input_output_aliases`).
  3. Short chunks (2 .. mosaic_min_q_len - 1 rows) and the padding rows run through the Triton kernel's
     prefill configuration, in place again.
Steps 2 and 3 are the two launches of ragged_paged_attention's split_decode path
(triton_attention.launch_rows), each told to leave the long chunks alone. The launches share the
grouped query layout of ragged_batch.py.

What neither Mosaic kernel covers runs on the Triton kernel (ragged_paged_attention) as a whole:
shorter block tables (step 1 skipped), a logit soft cap or sliding window, float32, page sizes below 8
or not dividing the kernels' KV blocks, and FP8 pages (kv_quant.py).

Why FP8 pages stay on the Triton kernel: both Mosaic kernels feed wgmma straight from the shared-memory
tiles TMA fills, and wgmma multiplies fp8 only by fp8 (e4m3/e5m2 on both sides). Reading fp8 pages there
would take either Q and P quantized to fp8 as well (an error beyond the cache's own, which vLLM's FP8
KV cache does not add) or a stage that upcasts each K/V tile from shared memory through registers into
a second, bf16 tile before the compute warpgroups read it (more shared memory per ring slot, fewer
stages, one more barrier per block), which is not built. The Triton kernel loads the pages in 8 bits and
upcasts them in registers, so FP8 decode still reads half the bytes (triton_attention.py).

Shapes (dimension letters as in jaxllm/kernels/__init__.py): q [T, Hq, D]; k_pages, v_pages
[Hkv, P, PS, D]; md: metadata.PagedAttentionMetadata of S sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels.kv_quant import is_fp8
from jaxllm.kernels.metadata import PagedAttentionMetadata, check_inputs
from jaxllm.kernels.mosaic_common import wait_for_inputs
from jaxllm.kernels.mosaic_decode import DecodeMgpuConfig, decode_launch, decode_rows, group_rows
from jaxllm.kernels.mosaic_prefill import prefill_paged_attention_mgpu
from jaxllm.kernels.mosaic_schedule import default_config as mgpu_default_config
from jaxllm.kernels.ragged_batch import decode_like, from_launch_layout, query_view, to_launch_layout
from jaxllm.kernels.triton_attention import DTYPES, launch_rows, ragged_paged_attention, resolve_config

# Decode-like batches take the persistent Mosaic decode kernel for their decode rows when they have at
# least DECODE_MIN_UNITS (row, KV head) units. Below that there are too few units to keep every SM
# streaming, and the Triton kernel's context splits keep more SMs busy (small-batch serving was slower
# with the Mosaic kernel; figures in docs/performance.md).
DECODE_MIN_UNITS = 256


# The Mosaic prefill kernel takes part only where a context can reach PREFILL_MIN_CONTEXT tokens (block-
# table width x page size, i.e. max_model_len). Its lead over the Triton kernel grows with the context,
# but for short prompts prefill attention is a few percent of a step's FLOPs, while each step variant
# that holds the kernel takes markedly longer to trace and lower, even with a warm compilation cache.
PREFILL_MIN_CONTEXT = 8192


def mosaic_covers(
    t: int,
    s: int,
    b: int,
    dtype,
    page_size: int,
    head_dim: int,
    *,
    soft_cap,
    sliding_window,
    min_context: int,
    kv_dtype=None,
) -> bool:
    """Whether the Mosaic prefill kernel takes part for these static shapes (b: block-table width in pages)
    and options. kv_dtype: the pages' dtype (None: q's); fp8 pages stay on Triton (module docstring)."""
    if soft_cap is not None or sliding_window is not None or decode_like(t, s):
        return False
    if kv_dtype is not None and is_fp8(kv_dtype):
        return False
    if b * page_size < min_context:
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return page_size >= 8 and mgpu_default_config(head_dim).block_kv % page_size == 0


def decode_mosaic_covers(
    t: int,
    s: int,
    hq: int,
    hkv: int,
    dtype,
    page_size: int,
    *,
    soft_cap,
    sliding_window,
    min_units: int,
    kv_dtype=None,
) -> bool:
    """Whether the Mosaic decode kernel takes the decode rows of this decode-like batch (static shapes).
    kv_dtype: the pages' dtype (None: q's); fp8 pages stay on Triton (module docstring)."""
    if soft_cap is not None or sliding_window is not None or not decode_like(t, s):
        return False
    if kv_dtype is not None and is_fp8(kv_dtype):
        return False
    if t * hkv < min_units:
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return page_size >= 8 and DecodeMgpuConfig().block_kv % page_size == 0 and group_rows(hq, hkv) <= 64


def ragged_paged_attention_hopper(
    q,  # [T, Hq, D], or [T, >= q_heads, D] with q_heads
    k_pages,  # [Hkv, P, PS, D]
    v_pages,  # [Hkv, P, PS, D]
    md: PagedAttentionMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    mosaic_min_q_len: int = 128,
    prefill_min_context: int = PREFILL_MIN_CONTEXT,
    decode_min_units: int = DECODE_MIN_UNITS,
    interpret: bool = False,
    q_heads: int | None = None,
    k_scale=1.0,
    v_scale=1.0,
):
    """Same contract and result as ref_ragged_paged_attention; decode batches and (with long block tables)
    long prefill chunks on the Mosaic GPU kernels (sm_90), everything else on the Triton-lowered kernel
    (module docstring). prefill_min_context and decode_min_units move the static rules (tests set them
    to route small problems to the Mosaic kernels). q_heads: as in ragged_paged_attention (a fused q|k|v).
    k_scale, v_scale: fp8 pages' scales (kv_quant.py), which only the Triton kernel reads (fp8 pages
    never reach the Mosaic kernels).

    Compiled as one jitted computation on the GPU. In interpret mode the parts run one by one instead:
    Mosaic GPU's interpreter runs the kernel's threads as host callbacks, which wait forever when the
    XLA CPU computation calling them also holds the interpreted Triton launches."""
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    kw.update(
        mosaic_min_q_len=mosaic_min_q_len, prefill_min_context=prefill_min_context, decode_min_units=decode_min_units,
        q_heads=q_heads,
    )  # fmt: skip
    args = (q, k_pages, v_pages, md)
    if interpret:
        return _hopper(*args, interpret=True, k_scale=k_scale, v_scale=v_scale, **kw)
    return _hopper_jit(*args, interpret=False, k_scale=k_scale, v_scale=v_scale, **kw)


def _hopper(
    q, k_pages, v_pages, md,
    *, sm_scale, soft_cap, sliding_window, mosaic_min_q_len, prefill_min_context, decode_min_units, interpret,
    q_heads, k_scale, v_scale,
):  # fmt: skip
    check_inputs(
        query_view(q, q_heads), k_pages, v_pages, md, dtypes=DTYPES, sliding_window=sliding_window,
        soft_cap=soft_cap,
    )  # fmt: skip
    if mosaic_min_q_len < 2:
        raise ValueError(f"{mosaic_min_q_len=} must be >= 2 (decode rows stay on the Triton kernel)")
    t, _, d = q.shape
    hq = q_heads or q.shape[1]
    hkv, _, ps, _ = k_pages.shape
    s, b = md.block_tables.shape
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)
    cover = dict(
        soft_cap=soft_cap, sliding_window=sliding_window, min_units=decode_min_units, kv_dtype=k_pages.dtype
    )
    if decode_mosaic_covers(t, s, hq, hkv, q.dtype, ps, **cover):
        qs = q[:, :hq]  # the query heads (XLA fuses the cut into the padding copy _decode_like makes)
        return _decode_like(qs, k_pages, v_pages, md, **kw)
    prefill_cover = dict(
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        min_context=prefill_min_context,
        kv_dtype=k_pages.dtype,
    )
    if not mosaic_covers(t, s, b, q.dtype, ps, d, **prefill_cover):
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        return ragged_paged_attention(q, k_pages, v_pages, md, q_heads=q_heads, **kw, **scales)

    long_rows = prefill_paged_attention_mgpu(
        q[:, :hq], k_pages, v_pages, md, sm_scale=sm_scale, min_q_len=mosaic_min_q_len, interpret=interpret
    )
    pcfg = resolve_config(t, s, hq, hkv, d, ps, b, k_splits=1)
    dcfg = resolve_config(s, s, hq, hkv, d, ps, b, k_splits=1)
    # The Triton launches work in launch layout; in interpret mode with room past T for its clamped
    # slices (as in ragged_paged_attention).
    extra_rows = max(pcfg["block_q"], dcfg["block_q"]) if interpret else 0
    qg = to_launch_layout(q, hkv, extra_rows, q_heads=q_heads)
    out = to_launch_layout(long_rows, hkv, extra_rows)
    launch = functools.partial(launch_rows, qg, k_pages, v_pages, md, t=t, max_q_len=mosaic_min_q_len, **kw)
    out = launch(dcfg, select="decode", num_items=s + 1, prior=out)
    out = launch(pcfg, select="prefill", prior=out)
    return from_launch_layout(out, t, hq)


def _decode_like(q, k_pages, v_pages, md, *, interpret, **kw):
    """A decode-like batch on the launch layout with query groups padded to whole 8-row tiles (the Mosaic
    kernel's TMA unit).

    With as many rows as sequences (T == S: the engine's decode buckets) every row goes to the Mosaic
    decode kernel, a row of a short chunk included (it reads its context up to its own position), and
    no Triton launch follows: T rows each reading at most the longest context is the cost of a full
    decode batch of that bucket anyway, whereas a Triton launch over an empty set of chunks still costs a
    launch and its schedule per layer. With more rows than sequences (up to 2 S) a chunk could
    multiply that bound, so only the decode rows go to the Mosaic kernel, and the short chunks and the
    padding rows to the Triton kernel's decode-like config, written into that output in place."""
    t, hq, d = q.shape
    hkv, _, ps, _ = k_pages.shape
    s, b = md.block_tables.shape
    all_rows = t == s
    cfg = resolve_config(t, s, hq, hkv, d, ps, b, k_splits=1)
    qg = to_launch_layout(q, hkv, cfg["block_q"] if interpret and not all_rows else 0, min_group=8)
    rows = decode_rows(md, qg.shape[0], only_decode=not all_rows)
    mcfg = DecodeMgpuConfig(pv_mode="smem") if interpret else DecodeMgpuConfig()
    wait_for_inputs(interpret, (qg, rows, k_pages, v_pages, md.block_tables))
    out = decode_launch(
        qg, k_pages, v_pages, rows, md.block_tables, sm_scale=kw["sm_scale"], config=mcfg, interpret=interpret
    )
    if all_rows:
        return from_launch_layout(out, t, hq)
    out = launch_rows(
        qg, k_pages, v_pages, md, cfg, t=t, select="prefill", prior=out, interpret=interpret, **kw
    )
    return from_launch_layout(out, t, hq)


_hopper_jit = jax.jit(
    _hopper,
    static_argnames=(
        "sm_scale", "soft_cap", "sliding_window", "mosaic_min_q_len", "prefill_min_context", "decode_min_units",
        "interpret", "q_heads",
    ),
)  # fmt: skip
