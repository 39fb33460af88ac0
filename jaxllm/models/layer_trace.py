"""Decoder layers traced once per step shape, not once per layer.

`call_layer(model, layer, *arrays, **static)` runs `layer(*arrays, **static)` inside `model.__call__`.
Every layer of a model has the same code and the same parameter shapes, so the model's forward pass
traces the first layer's Python (Flax modules, attention, rotary) once through a jitted function and
reuses that trace for the other layers: `jax.jit(..., inline=True)` copies the cached jaxpr into the
step, so the step's StableHLO is the same text as with the plain loop (checked by a test) and runs the
same. Tracing a step then costs about one layer's Python instead of every layer's, and lowering gets
cheaper with it: a start-up cost paid under the GIL for every compiled bucket
(`python -m benchmarks.trace_cost` measures both ways).

The cache key is the layer module itself (class and fields, without its name) and the static
arguments, so a new layer class or configuration traces anew. A layer's code edited in place (a
notebook that patches a method of the same class) keeps the old trace until `jax.clear_caches()`; a
model built with `trace_layers_once=False` calls its layers directly. So does every call made for
research: while `nn.intercept_methods` is active or intermediates are captured, each layer runs as
itself, under its own name (`layers_1/mlp`), as plain linen.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from jaxllm.compat import flax_interceptors_active


@functools.partial(jax.jit, static_argnums=(0, 1), inline=True)
def _apply_layer(layer: nn.Module, static: tuple, params, *arrays):
    return layer.apply({"params": params}, *arrays, **dict(static))


def call_layer(model: nn.Module, layer: nn.Module, *arrays, **static):
    """`layer(*arrays, **static)`, with the trace shared by every layer of `model` (module docstring).
    `static` holds hashable Python values (floats, strings), which stay constants of the step."""
    if (
        model.is_initializing()
        or not getattr(model, "trace_layers_once", True)
        or model.is_mutable_collection("intermediates")
        or _interceptors_active()
    ):
        return layer(*arrays, **static)
    unbound = layer.clone(parent=None, name=None)
    return _apply_layer(unbound, tuple(sorted(static.items())), layer.variables["params"], *arrays)


def _interceptors_active() -> bool:
    """Whether an `nn.intercept_methods` context is open (flax keeps them on a thread-local stack)."""
    return flax_interceptors_active()
