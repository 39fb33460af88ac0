"""Paged attention for a model layer: write this step's K/V into the cache, then attend over it.

`(q, k, v, kv_cache, metadata) -> (out, kv_cache)`. The backend is chosen statically: "reference" runs the
plain-jnp ops of jaxllm.kernels (any platform; what the CPU uses), "pallas" runs the GPU kernels
(Triton-lowered, any CUDA GPU), "pallas-hopper" the same but long prefill chunks on the Mosaic GPU kernel
(sm_90 only; jaxllm/kernels/hopper_dispatch.py).
This is the only module of the model that calls into jaxllm.kernels.

FP8 caches (`kv_cache_dtype="fp8"`: pages of float8_e4m3fn or float8_e5m2) are read and written by every
backend (jaxllm/kernels/kv_quant.py): the write stores k / k_scale saturated to the format, attention
reads stored * k_scale (v_scale for V). The scales are per layer: `kv_cache_scales(module)` takes a
checkpoint's `k_scale` / `v_scale` from the attention module's params (f32[]) and 1.0 where it has none,
as vLLM does.

Under tensor parallelism (a "tp" mesh set by `jaxllm.parallel.mesh_context` while the step is traced) the
kernels run under `shard_map` over the head axis: each device attends with its own query heads and the
KV heads (cache pages included) they read; the kernels never see a sharding.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
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


def check_kv_cache_dtype(kv_cache_dtype: str, page_dtype, backend: str, device) -> None:
    """float8_e4m3fn pages on the GPU kernels need compute capability 8.9 or newer (Ada, Hopper): JAX's
    Triton lowering converts to and from e4m3 only there, so an older GPU would fail at compile time.
    e5m2 converts on any GPU. Raises ValueError naming the setting."""
    if backend not in ("pallas", "pallas-hopper") or jnp.dtype(page_dtype) != jnp.dtype(jnp.float8_e4m3fn):
        return
    cc = str(getattr(device, "compute_capability", "") or "")
    try:
        major, minor = (int(x) for x in cc.split(".")[:2])
    except ValueError:
        return  # not reported: the compiler has the last word
    if (major, minor) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} (--kv-cache-dtype; float8_e4m3fn pages) needs a GPU of compute "
            f"capability 8.9 or newer for the attention kernels; this one has {cc}: use fp8_e5m2"
        )


def kv_cache_scales(module) -> tuple:
    """(k_scale, v_scale) of an attention module's layer: its params `k_scale` / `v_scale` (f32[], from a
    checkpoint with an FP8 KV-cache scheme) where present, else 1.0. Only fp8 caches use them."""
    if getattr(getattr(module, "arch", None), "kv_cache_scales", False):
        return tuple(
            module.param(name, nn.initializers.ones_init(), (), jnp.float32)
            for name in ("k_scale", "v_scale")
        )
    return tuple(
        module.get_variable("params", name) if module.has_variable("params", name) else 1.0
        for name in ("k_scale", "v_scale")
    )


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
    k_scale=1.0,  # float or f32[]: fp8 pages hold k / k_scale (module docstring)
    v_scale=1.0,
) -> tuple[jax.Array, KVCache]:
    kw = dict(sm_scale=sm_scale, backend=backend, soft_cap=soft_cap, sliding_window=sliding_window)
    mesh = current_tp_mesh()
    if mesh is None:
        return _local_paged_attention(q, k, v, kv_cache, md, k_scale, v_scale, **kw)
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
        lambda q, k, v, c, m, ks, vs: _local_paged_attention(q, k, v, c, m, ks, vs, **kw),
        mesh=mesh,
        in_specs=(heads, heads, heads, pages, P(), P(), P()),  # md, scales: every device sees them whole
        out_specs=(heads, pages),
        check_vma=False,  # the GPU kernels carry no varying-axis annotations
    )(q, k, v, kv_cache, md, *_scale_arrays(k_scale, v_scale))


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
    k_scale=1.0,  # float or f32[]: fp8 pages hold k / k_scale (module docstring)
    v_scale=1.0,
) -> tuple[jax.Array, KVCache]:  # ([T, Hq, D], cache)
    """paged_attention of a fused q|k|v projection. The GPU kernels read q, k and v in place (the KV write
    at head offsets, the attention through a grouped view of the array), so nothing cuts them out first:
    two XLA kernels fewer per layer than q, k and v made apart. Under tensor parallelism
    the head axis splits shard by shard, which is the fused layout: each device gets its own
    [q_r | k_r | v_r]."""
    kw = dict(sm_scale=sm_scale, backend=backend, soft_cap=soft_cap, sliding_window=sliding_window)
    mesh = current_tp_mesh()
    if mesh is None:
        return _local_qkv_attention(qkv, kv_cache, md, k_scale, v_scale, num_q_heads=num_q_heads, **kw)
    n = mesh.shape[TP_AXIS]
    pages = (P(TP_AXIS, None, None, None), P(TP_AXIS, None, None, None))
    return jax.shard_map(
        lambda x, c, m, ks, vs: _local_qkv_attention(x, c, m, ks, vs, num_q_heads=num_q_heads // n, **kw),
        mesh=mesh,
        in_specs=(P(None, TP_AXIS, None), pages, P(), P(), P()),
        out_specs=(P(None, TP_AXIS, None), pages),
        check_vma=False,
    )(qkv, kv_cache, md, *_scale_arrays(k_scale, v_scale))


def _scale_arrays(k_scale, v_scale) -> tuple[jax.Array, jax.Array]:
    """The scales as f32[] arrays, the form shard_map passes to every device whole."""
    return jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)


def _local_qkv_attention(
    qkv, kv_cache, md, k_scale, v_scale, *, num_q_heads, sm_scale, backend, soft_cap, sliding_window
):
    hq = num_q_heads
    s = (qkv.shape[1] - hq) // 2
    if backend not in ("pallas", "pallas-hopper"):
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + s], qkv[:, hq + s :]
        kw = dict(sm_scale=sm_scale, backend=backend, soft_cap=soft_cap, sliding_window=sliding_window)
        return _local_paged_attention(q, k, v, kv_cache, md, k_scale, v_scale, **kw)
    from jaxllm.kernels import ops as gpu_ops

    k_pages, v_pages = gpu_ops.write_kv_cache(
        qkv, qkv, *kv_cache, md.slot_mapping, k_scale, v_scale, k_head=hq, v_head=hq + s
    )
    attend = (
        gpu_ops.ragged_paged_attention_hopper
        if backend == "pallas-hopper"
        else gpu_ops.ragged_paged_attention
    )
    out = attend(
        qkv, k_pages, v_pages, md.paged,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, q_heads=hq,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return out, (k_pages, v_pages)


def _local_paged_attention(
    q, k, v, kv_cache, md, k_scale, v_scale, *, sm_scale, backend, soft_cap, sliding_window
):
    k_pages, v_pages = kv_cache
    if backend in ("pallas", "pallas-hopper"):
        from jaxllm.kernels import ops as gpu_ops  # imported lazily: only GPU hosts need the kernels compiled

        write = gpu_ops.write_kv_cache
        hopper = backend == "pallas-hopper"
        attend = gpu_ops.ragged_paged_attention_hopper if hopper else gpu_ops.ragged_paged_attention
    else:
        write, attend = ref_write_kv_cache, ref_ragged_paged_attention
    k_pages, v_pages = write(k, v, k_pages, v_pages, md.slot_mapping, k_scale, v_scale)
    out = attend(
        q, k_pages, v_pages, md.paged,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return out, (k_pages, v_pages)
