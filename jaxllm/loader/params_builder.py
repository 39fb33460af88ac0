"""Fill a parameter tree one tensor at a time, checking each against the model's abstract tree.

checkpoint tensor (numpy or device array) -> `ParamsBuilder.put(path, x, transpose)` -> shape check ->
cast to the target dtype -> `jax.device_put` (optionally with a sharding chosen by path) -> stored; the
caller drops its host copy. `finish()` checks nothing is missing and returns the nested params dict.

Parts of a fused projection (the checkpoint's q/k/v or gate/up, models/fused_projections.py) are held
until the layer's last part arrives, then fused into the model's one weight and placed like any other.
A quantized layer's leaves (jaxllm/quantization/scheme.py) fuse the same way along N, except the two that
describe the shared input: `perm` (the parts must agree) and a static `input_scale` (the largest wins, as
in vLLM). N is the last axis of every leaf but a W8A8 `qweight`, held [N, K] (`_out_axis`). A float
`kernel` arriving for a layer the model holds quantized is quantized here, when the scheme says the
checkpoint is to be quantized at load (`--quantization fp8`).

A mixture-of-experts checkpoint holds one tensor per expert, which the name maps give as
"layers_3/mlp/experts/{e}/down_proj/kernel" (loader/names.py): each is held (transposed, cast) until the
layer's E experts of that projection have come, then stacked into [E, ...] and put under
"layers_3/mlp/experts/down_proj/kernel" like any tensor (gate and up then fuse as parts do).
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
from jaxllm.quantization.quantize import quantize_fp8
from jaxllm.quantization.scheme import QuantScheme

# (path "layers_0/attn/o_proj/kernel", ShapeDtypeStruct) -> sharding or None (default device)
ShardingFn = Callable[[str, jax.ShapeDtypeStruct], Any]

_LAYER_PREFIX = re.compile(r"^(layers_\d+/)(.+)/([^/]+)$")
_EXPERT = re.compile(r"^(layers_\d+/(?:.+/)?experts)/(\d+)/(.+)$")  # (stacked module, expert, rest)
_INPUT_LEAVES = ("perm", "input_scale")  # describe a fused layer's one input, not its parts' columns


class ParamsBuilder:
    def __init__(
        self,
        abstract: dict,
        source: str,
        sharding_fn: ShardingFn | None = None,
        fused_groups: tuple[FusedGroup, ...] = (),
        quant: QuantScheme | None = None,
    ):
        self.quant = quant
        self.expected = {"/".join(k): v for k, v in traverse_util.flatten_dict(abstract).items()}
        self.source = source
        self.sharding_fn = sharding_fn
        self.loaded: dict[str, jax.Array] = {}
        # a part's module path inside a layer ("attn/k_proj") -> (its group, its index there)
        self._parts = {p.name: (g, i) for g in fused_groups for i, p in enumerate(g.parts)}
        self._groups = {g.name: g for g in fused_groups}  # fused module path -> its group
        self._held: dict[str, dict[int, Any]] = {}  # fused path -> {part index: array}
        self._experts: dict[str, dict[int, Any]] = {}  # stacked path -> {expert: array}

    def put(self, path: str, x: Any, transpose: bool = False, tensor_name: str | None = None) -> None:
        name = tensor_name or path
        e = _EXPERT.match(path)
        if e:
            self._put_expert(f"{e.group(1)}/{e.group(3)}", int(e.group(2)), x, transpose, name)
            return
        if path.endswith("/kernel") and self._quantized(path) and path not in self.expected:
            self._quantize_at_load(path, x, transpose, name)
            return
        m = _LAYER_PREFIX.match(path)
        if m and m.group(2) in self._parts:
            self._put_part(m.group(1), m.group(2), m.group(3), x, transpose, name)
            return
        if m and m.group(2) in self._groups and m.group(3) in ("kernel", "bias"):
            self._put_whole(m.group(1), self._groups[m.group(2)], m.group(3), x, transpose, name)
            return
        if path not in self.expected:
            raise ValueError(
                f"{self.source}: tensor {name!r} maps to {path!r}, which this model does not have"
            )
        want = self.expected[path]
        self._place(path, self._checked(x, tuple(want.shape), want.dtype, transpose, name))

    def _put_expert(self, path: str, expert: int, x: Any, transpose: bool, name: str) -> None:
        """Hold one expert's tensor; with the last of the layer's E experts, put them stacked [E, ...]."""
        target = self._fused_path(path)
        if target not in self.expected:
            raise ValueError(
                f"{self.source}: tensor {name!r} maps to {path!r}, which this model does not have"
            )
        want = self.expected[target]
        num_experts = want.shape[0]
        if expert >= num_experts:
            raise ValueError(
                f"{self.source}: tensor {name!r} is expert {expert}, but the config has num_experts={num_experts}"
            )
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x.T if transpose else x).astype(want.dtype, copy=False)
        else:
            x = jnp.asarray(x).astype(want.dtype)
            x = x.T if transpose else x
        held = self._experts.setdefault(path, {})
        held[expert] = x
        if len(held) == num_experts:
            del self._experts[path]
            stack = np.stack if all(isinstance(v, np.ndarray) for v in held.values()) else jnp.stack
            self.put(path, stack([held[j] for j in range(num_experts)]), tensor_name=f"{name} (all experts)")

    def _quantized(self, kernel_path: str) -> bool:
        return kernel_path.removesuffix("kernel") + "qweight" in self.expected or (
            self._fused_path(kernel_path).removesuffix("kernel") + "qweight" in self.expected
        )

    def _fused_path(self, path: str) -> str:
        m = _LAYER_PREFIX.match(path)
        if m and m.group(2) in self._parts:
            return f"{m.group(1)}{self._parts[m.group(2)][0].name}/{m.group(3)}"
        return path

    def _quantize_at_load(self, path: str, x: Any, transpose: bool, name: str) -> None:
        if self.quant is None or not self.quant.online:
            raise ValueError(
                f"{self.source}: tensor {name!r} is a float weight, but the checkpoint's quantization "
                f"({self.quant.describe() if self.quant else 'none'}) stores this layer quantized"
            )
        w = jnp.asarray(x)
        w = w.T if transpose and w.ndim == 2 else w
        for leaf, value in quantize_fp8(w).items():
            self.put(path.removesuffix("kernel") + leaf, value, tensor_name=name)

    def _put_part(self, layer: str, module: str, leaf: str, x: Any, transpose: bool, name: str) -> None:
        group, i = self._parts[module]
        path = f"{layer}{group.name}/{leaf}"
        if path not in self.expected:
            raise ValueError(
                f"{self.source}: tensor {name!r} is part of {path!r}, which this model does not have"
            )
        want = self.expected[path]
        part = group.parts[i]
        shared = leaf in _INPUT_LEAVES
        axis = self._out_axis(path)
        shape = list(want.shape)
        if not shared:
            shape[axis] = part.heads * part.head_width
        held = self._held.setdefault(path, {})
        held[i] = self._checked(x, tuple(shape), want.dtype, transpose, name)
        if len(held) == len(group.parts):
            del self._held[path]
            parts = [held[j] for j in range(len(group.parts))]
            fused = self._input_leaf(path, leaf, parts) if shared else fuse_columns(group, parts, axis)
            self._place(path, fused)

    def _put_whole(
        self, layer: str, group: FusedGroup, leaf: str, x: Any, transpose: bool, name: str
    ) -> None:
        """A checkpoint that holds a fused projection whole (Phi-3's qkv_proj [(Nq + 2 Nkv) D, H] and
        gate_up_proj [2 I, H]): cut along its outputs into the parts, as wide as they are unsharded, and
        put each as a part, so the fused weight takes the model's layout (models/fused_projections.py)."""
        axis = 0 if transpose or leaf == "bias" else x.ndim - 1  # the outputs: rows of [out, in]
        widths = [p.heads * p.head_width for p in group.parts]
        if x.shape[axis] != sum(widths):
            raise ValueError(
                f"{self.source}: tensor {name!r} has shape {tuple(x.shape)}; the config implies "
                f"{sum(widths)} outputs ({' + '.join(map(str, widths))}: {', '.join(p.name for p in group.parts)})"
            )
        start = 0
        for part, width in zip(group.parts, widths, strict=True):
            piece = x[start : start + width] if axis == 0 else x[..., start : start + width]
            self._put_part(layer, part.name, leaf, piece, transpose, name)
            start += width

    def _out_axis(self, path: str) -> int:
        """The axis of a leaf that holds the layer's outputs N: the last one, but 0 for a W8A8 qweight
        [N, K] (scheme.py: the FP8 GEMM takes K contiguous). A layer is W8A8 when it has a weight_scale.
        The checkpoint formats and the quantizers hand W8A8 qweights over [N, K] already."""
        if path.endswith("/qweight") and path.removesuffix("qweight") + "weight_scale" in self.expected:
            return 0
        return -1

    def _input_leaf(self, path: str, leaf: str, parts: list) -> Any:
        if leaf == "input_scale":
            return jnp.max(jnp.stack([jnp.asarray(p) for p in parts]))
        if any(not np.array_equal(np.asarray(parts[0]), np.asarray(p)) for p in parts[1:]):
            raise ValueError(
                f"{self.source}: the parts of {path.rsplit('/', 1)[0]} reorder their inputs differently "
                "(act-order g_idx); jaxllm fuses them and needs one order"
            )
        return parts[0]

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
        for path, held in sorted(self._experts.items()):  # a projection some experts of which never came
            lacks = sorted(set(range(self.expected[self._fused_path(path)].shape[0])) - set(held))
            raise ValueError(f"{self.source}: missing weights for {path} of experts {lacks[:8]}")
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
