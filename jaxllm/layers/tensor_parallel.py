"""The tensor-parallel mesh as the model side sees it: the axis its heads split over and the mesh of the
step being traced.

The layers own both, so the model never imports jaxllm.parallel: parallel/ builds the mesh over
`TP_AXIS` and traces the step inside `tp_mesh_context(mesh)` (its `mesh_context`); the attention layer
reads it back with `current_tp_mesh()` at trace time and runs its kernels under `shard_map`. No model
module carries sharding state, and a model traced without a mesh runs on one device unchanged.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import Mesh

TP_AXIS = "tp"


def tp_mesh_context(mesh: Mesh | None):
    """Context under which jitted steps are traced (and run); a no-op without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def current_tp_mesh():
    """The mesh of `tp_mesh_context` when it has a "tp" axis of size > 1 (read at trace time), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names or mesh.shape[TP_AXIS] == 1:
        return None
    return mesh
