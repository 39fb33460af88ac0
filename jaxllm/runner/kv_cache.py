"""The device KV cache: its size, its allocation, and block swaps to host memory.

One `(k_pages, v_pages)` pair per layer, each [Hkv, P, PS, D], allocated once and donated into every step
so XLA updates it in place. The number of pages P comes from `gpu_memory_utilization`: the device's memory
limit (XLA's allocator pool, which the entry points size from the same fraction) minus the weights and the
largest step's temporaries (from the compiled step's memory analysis), or from `num_gpu_blocks_override`.
Swapped-out blocks live in numpy arrays of the same layout with `num_cpu_blocks` pages.

The pages' dtype comes from `kv_cache_dtype` (vLLM's names, `kv_page_dtype`): "auto" is the weights',
"fp8" / "fp8_e4m3" / "fp8_e5m2" are one-byte pages holding K/V scaled by each layer's k_scale / v_scale
(jaxllm/kernels/kv_quant.py). Every size here is counted in bytes of that dtype, so an fp8 cache holds
twice the blocks of a bf16 one in the same memory; swaps copy the stored bytes as they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger("jaxllm")

# Memory kept free beyond the estimate: allocator fragmentation, the sampler's V-wide temporaries and
# small buffers outside the step (a 512 MiB margin ran out of memory at the Llama-3.1-8B shape).
_SAFETY_BYTES = 2 << 30
_CPU_KV_BUDGET_BYTES = int(os.environ.get("JAXLLM_CPU_KV_CACHE_BYTES", 1 << 30))

# vLLM's --kv-cache-dtype names of 8-bit caches, and the page dtype each stores ("fp8" is e4m3, as there).
FP8_KV_CACHE_DTYPES = {
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}


def kv_page_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The KV pages' dtype for a `kv_cache_dtype` setting (config.KV_CACHE_DTYPES): "auto" is the
    weights' dtype, an fp8 name its float8 type, any other name that dtype."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    return jnp.dtype(FP8_KV_CACHE_DTYPES.get(kv_cache_dtype, kv_cache_dtype))


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: jnp.dtype

    @property
    def bytes_per_block(self) -> int:
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.block_size
            * self.head_dim
            * jnp.dtype(self.dtype).itemsize
        )

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)


def device_memory_budget(util: float) -> tuple[int, int] | None:
    """(limit, in_use) bytes of the first device, or None where the platform reports no memory stats."""
    stats = jax.local_devices()[0].memory_stats()  # addressable on every host
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def num_blocks_for_memory(
    geo: KVGeometry, util: float, step_temp_bytes: int, max_useful_blocks: int, shards: int = 1
) -> tuple[int, str]:
    """How many KV blocks fit, and a sentence saying how that was decided (for the startup log).

    `shards`: devices the cache is split over (tensor parallel); the device budget is one device's.
    """
    mem = device_memory_budget(util)
    if mem is None:
        n = max(1, min(_CPU_KV_BUDGET_BYTES // geo.bytes_per_block, max_useful_blocks))
        return (
            n,
            f"host platform: KV budget {_CPU_KV_BUDGET_BYTES / 2**30:.2f} GiB (JAXLLM_CPU_KV_CACHE_BYTES)",
        )
    limit, in_use = mem
    free = limit - in_use - step_temp_bytes - _SAFETY_BYTES - int(0.02 * limit)
    n = free // (geo.bytes_per_block // shards)
    why = (
        f"device memory pool {limit / 2**30:.1f} GiB, weights and buffers {in_use / 2**30:.2f} GiB, "
        f"largest step's temporaries {step_temp_bytes / 2**30:.2f} GiB"
    )
    if n < 1:
        raise ValueError(
            f"no memory left for the KV cache ({why}); raise gpu_memory_utilization or lower "
            "max_num_batched_tokens / max_model_len"
        )
    return int(n), why


def allocate(geo: KVGeometry, num_blocks: int, sharding=None) -> list[tuple[jax.Array, jax.Array]]:
    shape = geo.layer_shape(num_blocks)

    def zeros():
        if sharding is None:
            return jnp.zeros(shape, geo.dtype)
        return jax.jit(lambda: jnp.zeros(shape, geo.dtype), out_shardings=sharding)()

    return [(zeros(), zeros()) for _ in range(geo.num_layers)]


def _pad_ids(ids: list[int]) -> np.ndarray:
    n = 1 << max(0, (len(ids) - 1).bit_length())
    out = np.full(n, ids[0], np.int32)
    out[: len(ids)] = ids
    return out


@jax.jit
def _gather_blocks(kv_caches, ids):  # ids: i32[N]
    return [(k[:, ids], v[:, ids]) for k, v in kv_caches]


def _scatter_blocks(kv_caches, ids, blocks):  # ids: i32[N]; blocks: per layer ([Hkv, N, PS, D], ...)
    return [(k.at[:, ids].set(bk), v.at[:, ids].set(bv)) for (k, v), (bk, bv) in zip(kv_caches, blocks)]


_scatter_blocks_donated = jax.jit(_scatter_blocks, donate_argnums=(0,))


class HostSwapSpace:
    """Host copies of swapped-out KV blocks (swap_space > 0)."""

    def __init__(self, geo: KVGeometry, num_cpu_blocks: int):
        self.num_blocks = num_cpu_blocks
        shape = geo.layer_shape(num_cpu_blocks)
        self.layers = [
            (np.zeros(shape, np.dtype(geo.dtype)), np.zeros(shape, np.dtype(geo.dtype)))
            for _ in range(geo.num_layers)
        ]

    def swap_out(self, kv_caches, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        dev = [d for d, _ in pairs]
        host = np.asarray([h for _, h in pairs])
        got = jax.device_get(_gather_blocks(kv_caches, jnp.asarray(_pad_ids(dev))))
        for (hk, hv), (gk, gv) in zip(self.layers, got):
            hk[:, host] = gk[:, : len(pairs)]
            hv[:, host] = gv[:, : len(pairs)]

    def swap_in(self, kv_caches, pairs: list[tuple[int, int]]):
        if not pairs:
            return kv_caches
        # Pairs are (device block, host block) in both directions, as the scheduler lists them.
        host = [h for _, h in pairs]
        dev = _pad_ids([d for d, _ in pairs])
        host_idx = _pad_ids(host)  # padding repeats the first pair: the same value written twice
        blocks = [(hk[:, host_idx], hv[:, host_idx]) for hk, hv in self.layers]
        return _scatter_blocks_donated(kv_caches, jnp.asarray(dev), blocks)
