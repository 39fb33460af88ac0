"""Tensor parallelism over one mesh axis ("tp"), on one host or several.

ParallelConfig -> initialize_distributed (multi-host only, before any other jax use)
               -> build_mesh(N) -> param_sharding_fn (loader places each param by path rule)
                                -> kv_cache_sharding (KV cache split on its head axis)
                                -> mesh_context: the model step is traced under it, so the
                                   attention layer runs its kernels under shard_map.
"""

from jaxllm.models.registry import kv_cache_heads
from jaxllm.parallel.distributed import agree_on_min, initialize_distributed, resolve_distributed
from jaxllm.parallel.mesh import TP_AXIS, build_mesh, current_tp_mesh, mesh_context
from jaxllm.parallel.plan import TensorParallelPlan, plan_tensor_parallel
from jaxllm.parallel.sharding import (
    kv_cache_sharding,
    param_partition_spec,
    param_sharding_fn,
    validate_tensor_parallel,
)

__all__ = [
    "TP_AXIS",
    "TensorParallelPlan",
    "agree_on_min",
    "build_mesh",
    "current_tp_mesh",
    "initialize_distributed",
    "kv_cache_heads",
    "kv_cache_sharding",
    "mesh_context",
    "param_partition_spec",
    "param_sharding_fn",
    "plan_tensor_parallel",
    "resolve_distributed",
    "validate_tensor_parallel",
]
