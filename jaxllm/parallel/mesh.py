"""The device mesh: one axis, "tp", over the first N devices of every process (all hosts together).

`build_mesh(N)` checks N against the devices jax sees (after `initialize_distributed`, that is every
host's devices). The engine traces the model step inside `mesh_context(mesh)`; the attention layer reads
the mesh back with `current_tp_mesh()` at trace time, so no model module carries sharding state. The axis
name and the context belong to the layers (jaxllm/layers/tensor_parallel.py): the model never imports this
package, this package imports the model's.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from jaxllm.layers.tensor_parallel import TP_AXIS, current_tp_mesh
from jaxllm.layers.tensor_parallel import tp_mesh_context as mesh_context

__all__ = ["TP_AXIS", "build_mesh", "current_tp_mesh", "mesh_context"]


def build_mesh(tensor_parallel_size: int) -> Mesh | None:
    """A 1-D mesh of `tensor_parallel_size` devices, or None for 1 (a single device needs no mesh)."""
    n = tensor_parallel_size
    if n < 1:
        raise ValueError(f"tensor_parallel_size={n} must be >= 1")
    if n == 1:
        return None
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(
            f"tensor_parallel_size={n} exceeds the {len(devices)} {jax.default_backend()} device(s) visible "
            f"({jax.process_count()} process(es) with {jax.local_device_count()} local device(s) each)"
        )
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(
            f"tensor_parallel_size={n} must equal the {len(devices)} devices of all "
            f"{jax.process_count()} processes when running on several hosts"
        )
    # Auto axes: XLA's SPMD partitioner chooses the layout of intermediates and inserts the collectives.
    return Mesh(devices[:n], (TP_AXIS,), axis_types=(AxisType.Auto,))
