"""What the engine needs for tensor parallelism, decided once before the model loads.

tensor_parallel_size N + the opened model's architecture (loader.open_model: config files only, with the
quantization scheme, which the sharding rules read) -> validate N against heads / devices ->
TensorParallelPlan(mesh, sharding_fn for the loader, kv_sharding and head slots for the KV cache,
context() under which steps are traced). N == 1 gives an empty plan: no mesh, no shardings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jax.sharding import Mesh, NamedSharding

from jaxllm.models.registry import kv_cache_heads
from jaxllm.parallel.mesh import TP_AXIS, build_mesh, mesh_context
from jaxllm.parallel.sharding import kv_cache_sharding, param_sharding_fn, validate_tensor_parallel

if TYPE_CHECKING:
    from jaxllm.models.config import ModelArchConfig


@dataclass(frozen=True)
class TensorParallelPlan:
    mesh: Mesh | None
    arch: ModelArchConfig | None  # None without a mesh

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[TP_AXIS]

    @property
    def sharding_fn(self):
        return None if self.mesh is None else param_sharding_fn(self.mesh, self.arch)

    @property
    def kv_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else kv_cache_sharding(self.mesh)

    def kv_heads(self, num_kv_heads: int) -> int:
        """Head slots of the KV cache (N when KV heads are replicated over N > Hkv devices)."""
        return num_kv_heads if self.mesh is None else kv_cache_heads(self.arch, self.size)

    def context(self):
        return mesh_context(self.mesh)


def plan_tensor_parallel(tensor_parallel_size: int, arch: ModelArchConfig) -> TensorParallelPlan:
    """Raises ValueError (naming the numbers) when N exceeds the devices or does not fit the heads."""
    mesh = build_mesh(tensor_parallel_size)
    if mesh is None:
        return TensorParallelPlan(None, None)
    validate_tensor_parallel(arch, tensor_parallel_size)
    return TensorParallelPlan(mesh, arch)
