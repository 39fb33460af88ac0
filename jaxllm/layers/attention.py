"""Paged attention for a model layer: write this step's K/V into the cache, then attend over it.

`(q, k, v, kv_cache, metadata) -> (out, kv_cache)`. The backend is chosen statically: "reference" runs the
plain-jnp ops of jaxllm.kernels (any platform; what the CPU uses), "pallas" runs the GPU kernels
(Triton-lowered, any CUDA GPU), "pallas-hopper" the same but long prefill chunks on the Mosaic GPU kernel
(sm_90 only; jaxllm/kernels/hopper_dispatch.py).
This is the only module of the model that calls into jaxllm.kernels.

Under tensor parallelism (a "tp" mesh set by `jaxllm.parallel.mesh_context` while the step is traced) the
kernels run under `shard_map` over the head axis: each device attends with its own query heads and the
KV heads (cache pages included) they read; the kernels never see a sharding.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxllm.kernels.kv_write_xla import ref_write_kv_cache
from jaxllm.kernels.reference import ref_ragged_paged_attention
from jaxllm.layers.attention_metadata import AttentionMetadata, KVCache
from jaxllm.layers.tensor_parallel import TP_AXIS, current_tp_mesh


def resolve_backend(backend: str) -> str:
    """ "auto": on a Hopper GPU (sm_90) "pallas-hopper", whose persistent Mosaic GPU decode kernel reads
    the KV cache faster than the Triton kernel at large batches (benchmarks/decode_mgpu.py,
    docs/performance.md); on other GPUs the Triton-lowered "pallas"; the plain-jnp reference elsewhere."""
    if backend != "auto":
        return backend
    if jax.default_backend() != "gpu":
        return "reference"
    return "pallas-hopper" if is_hopper(jax.devices()[0]) else "pallas"


def is_hopper(device) -> bool:
    """sm_90 (H100/H200/GH200): what the Mosaic GPU kernels (wgmma, TMA) are built for."""
    return str(getattr(device, "compute_capability", "")).split(".")[0] == "9"


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: KVCache,  # ([Hkv, P, PS, D], [Hkv, P, PS, D])
    md: AttentionMetadata,
    *,
    sm_scale: float,
    backend: str = "reference",
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[jax.Array, KVCache]:
    kw = dict(sm_scale=sm_scale, backend=backend, soft_cap=soft_cap, sliding_window=sliding_window)
    mesh = current_tp_mesh()
    if mesh is None:
        return _local_paged_attention(q, k, v, kv_cache, md, **kw)
    n, hkv = mesh.shape[TP_AXIS], k.shape[1]
    if hkv % n:
        raise ValueError(
            f"{hkv} KV heads do not split over {n} devices: with separate K/V projections every device needs "
            "its own KV heads (models that have fewer KV heads than devices hold q|k|v fused, with one K/V "
            "slot per device: models/fused_projections.py)"
        )
    heads = P(None, TP_AXIS, None)  # q [T, Hq/N, D], k and v [T, Hkv/N, D], out [T, Hq/N, D]
    pages = (P(TP_AXIS, None, None, None), P(TP_AXIS, None, None, None))  # this device's cache heads
    return jax.shard_map(
        lambda q, k, v, c, m: _local_paged_attention(q, k, v, c, m, **kw),
        mesh=mesh,
        in_specs=(heads, heads, heads, pages, P()),  # md: every device sees the whole batch
        out_specs=(heads, pages),
        check_vma=False,  # the GPU kernels carry no varying-axis annotations
    )(q, k, v, kv_cache, md)


def paged_attention_qkv(
    qkv: jax.Array,  # [T, Hq + 2 S, D]: q|k|v heads (per shard: models/fused_projections.py)
    kv_cache: KVCache,  # ([S, P, PS, D], [S, P, PS, D])
    md: AttentionMetadata,
    *,
    num_q_heads: int,  # Hq
    sm_scale: float,
    backend: str = "reference",
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[jax.Array, KVCache]:  # ([T, Hq, D], cache)
    """paged_attention of a fused q|k|v projection. The GPU kernels read q, k and v in place (the KV write
    at head offsets, the attention through a grouped view of the array), so nothing cuts them out first:
    two XLA kernels fewer per layer than q, k and v made apart. Under tensor parallelism
    the head axis splits shard by shard, which is the fused layout: each device gets its own
    [q_r | k_r | v_r]."""
    kw = dict(sm_scale=sm_scale, backend=backend, soft_cap=soft_cap, sliding_window=sliding_window)
    mesh = current_tp_mesh()
    if mesh is None:
        return _local_qkv_attention(qkv, kv_cache, md, num_q_heads=num_q_heads, **kw)
    n = mesh.shape[TP_AXIS]
    pages = (P(TP_AXIS, None, None, None), P(TP_AXIS, None, None, None))
    return jax.shard_map(
        lambda x, c, m: _local_qkv_attention(x, c, m, num_q_heads=num_q_heads // n, **kw),
        mesh=mesh,
        in_specs=(P(None, TP_AXIS, None), pages, P()),
        out_specs=(P(None, TP_AXIS, None), pages),
        check_vma=False,
    )(qkv, kv_cache, md)


def _local_qkv_attention(qkv, kv_cache, md, *, num_q_heads, sm_scale, backend, soft_cap, sliding_window):
    hq = num_q_heads
    s = (qkv.shape[1] - hq) // 2
    if backend not in ("pallas", "pallas-hopper"):
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + s], qkv[:, hq + s :]
        kw = dict(sm_scale=sm_scale, backend=backend, soft_cap=soft_cap, sliding_window=sliding_window)
        return _local_paged_attention(q, k, v, kv_cache, md, **kw)
    from jaxllm.kernels import ops as gpu_ops

    k_pages, v_pages = gpu_ops.write_kv_cache(qkv, qkv, *kv_cache, md.slot_mapping, k_head=hq, v_head=hq + s)
    attend = (
        gpu_ops.ragged_paged_attention_hopper
        if backend == "pallas-hopper"
        else gpu_ops.ragged_paged_attention
    )
    out = attend(
        qkv, k_pages, v_pages, md.paged,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, q_heads=hq,
    )  # fmt: skip
    return out, (k_pages, v_pages)


def _local_paged_attention(q, k, v, kv_cache, md, *, sm_scale, backend, soft_cap, sliding_window):
    k_pages, v_pages = kv_cache
    if backend in ("pallas", "pallas-hopper"):
        from jaxllm.kernels import ops as gpu_ops  # imported lazily: only GPU hosts need the kernels compiled

        write = gpu_ops.write_kv_cache
        hopper = backend == "pallas-hopper"
        attend = gpu_ops.ragged_paged_attention_hopper if hopper else gpu_ops.ragged_paged_attention
    else:
        write, attend = ref_write_kv_cache, ref_ragged_paged_attention
    k_pages, v_pages = write(k, v, k_pages, v_pages, md.slot_mapping)
    out = attend(
        q, k_pages, v_pages, md.paged, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window
    )
    return out, (k_pages, v_pages)
