"""The device mesh: one axis, "tp", over the first N devices of every process (all hosts together).

`build_mesh(N)` checks N against the devices jax sees (after `initialize_distributed`, that is every
host's devices). The engine traces the model step inside `mesh_context(mesh)`; the attention layer reads
the mesh back with `current_tp_mesh()` at trace time, so no model module carries sharding state.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import AxisType, Mesh

TP_AXIS = "tp"


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


def mesh_context(mesh: Mesh | None):
    """Context under which jitted steps are traced (and run); a no-op without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def current_tp_mesh():
    """The mesh set by `mesh_context` when it has a "tp" axis of size > 1 (read at trace time), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names or mesh.shape[TP_AXIS] == 1:
        return None
    return mesh
