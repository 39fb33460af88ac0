"""Fill a parameter tree one tensor at a time, checking each against the model's abstract tree.

checkpoint tensor (numpy or device array) -> `ParamsBuilder.put(path, x, transpose)` -> shape check ->
cast to the target dtype -> `jax.device_put` (optionally with a sharding chosen by path) -> stored; the
caller drops its host copy. `finish()` checks nothing is missing and returns the nested params dict.

Parts of a fused projection (the checkpoint's q/k/v or gate/up, models/fused_projections.py) are held
until the layer's last part arrives, then fused into the model's one weight and placed like any other.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxllm.models.fused_projections import FusedGroup, fuse_columns

# (path "layers_0/attn/o_proj/kernel", ShapeDtypeStruct) -> sharding or None (default device)
ShardingFn = Callable[[str, jax.ShapeDtypeStruct], Any]

_LAYER_PREFIX = re.compile(r"^(layers_\d+/)(.+)/([^/]+)$")


class ParamsBuilder:
    def __init__(
        self,
        abstract: dict,
        source: str,
        sharding_fn: ShardingFn | None = None,
        fused_groups: tuple[FusedGroup, ...] = (),
    ):
        self.expected = {"/".join(k): v for k, v in traverse_util.flatten_dict(abstract).items()}
        self.source = source
        self.sharding_fn = sharding_fn
        self.loaded: dict[str, jax.Array] = {}
        # a part's module path inside a layer ("attn/k_proj") -> (its group, its index there)
        self._parts = {p.name: (g, i) for g in fused_groups for i, p in enumerate(g.parts)}
        self._groups = {g.name: g for g in fused_groups}  # fused module path -> its group
        self._held: dict[str, dict[int, Any]] = {}  # fused path -> {part index: array}

    def put(self, path: str, x: Any, transpose: bool = False, tensor_name: str | None = None) -> None:
        name = tensor_name or path
        m = _LAYER_PREFIX.match(path)
        if m and m.group(2) in self._parts:
            self._put_part(m.group(1), m.group(2), m.group(3), x, transpose, name)
            return
        if path not in self.expected:
            raise ValueError(
                f"{self.source}: tensor {name!r} maps to {path!r}, which this model does not have"
            )
        want = self.expected[path]
        self._place(path, self._checked(x, tuple(want.shape), want.dtype, transpose, name))

    def _put_part(self, layer: str, module: str, leaf: str, x: Any, transpose: bool, name: str) -> None:
        group, i = self._parts[module]
        path = f"{layer}{group.name}/{leaf}"
        if path not in self.expected:
            raise ValueError(
                f"{self.source}: tensor {name!r} is part of {path!r}, which this model does not have"
            )
        want = self.expected[path]
        part = group.parts[i]
        shape = (*want.shape[:-1], part.heads * part.head_width)
        held = self._held.setdefault(path, {})
        held[i] = self._checked(x, shape, want.dtype, transpose, name)
        if len(held) == len(group.parts):
            del self._held[path]
            self._place(path, fuse_columns(group, [held[j] for j in range(len(group.parts))]))

    def _checked(self, x: Any, shape: tuple, dtype, transpose: bool, name: str) -> Any:
        """x transposed (if asked) and cast to `dtype`, after checking it has `shape` once transposed."""
        got = tuple(x.shape[::-1]) if transpose and x.ndim == 2 else tuple(x.shape)
        if got != shape:
            raise ValueError(
                f"{self.source}: tensor {name!r} has shape {tuple(x.shape)}; the config implies "
                f"{shape[::-1] if transpose else shape}"
            )
        if isinstance(x, np.ndarray):
            return np.ascontiguousarray(x.T if transpose else x).astype(dtype, copy=False)
        arr = jnp.asarray(x).astype(dtype)
        return arr.T if transpose else arr

    def _place(self, path: str, x: Any) -> None:
        want = self.expected[path]
        sharding = self.sharding_fn(path, want) if self.sharding_fn else None
        if isinstance(x, np.ndarray) or sharding is not None:
            x = jax.device_put(x, sharding)
        self.loaded[path] = x

    def finish(self) -> dict:
        missing = sorted(set(self.expected) - set(self.loaded))
        if missing:
            missing = [self._describe_missing(p) for p in missing]
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"{self.source}: missing weights for {', '.join(missing[:5])}{more}")
        return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in self.loaded.items()})

    def _describe_missing(self, path: str) -> str:
        """A fused weight names the checkpoint parts it still lacks."""
        m = _LAYER_PREFIX.match(path)
        group = self._groups.get(m.group(2)) if m else None
        if group is None:
            return path
        have = self._held.get(path, {})
        lacks = [f"{m.group(1)}{p.name}/{m.group(3)}" for j, p in enumerate(group.parts) if j not in have]
        return f"{', '.join(lacks)} (parts of {path})"
