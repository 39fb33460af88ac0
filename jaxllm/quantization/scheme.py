"""`QuantScheme`: how the linear layers of a quantized model hold and use their weights.

Every quantized checkpoint format (AWQ, GPTQ, compressed-tensors, the HF/vLLM `fp8` format, GGUF) and
the load-time quantization of a float checkpoint (`--quantization fp8`) end in one of four canonical
layouts, so the layer (jaxllm/layers/linear.py), the kernels and the tensor-parallel rules know four
layouts instead of every format. Per linear layer with K inputs, N outputs and group size g (g = K when
scales are per output channel):

  weights "int4", activations None (W4A16):
      qweight u8[K/2, N]    byte j of column n = q[2j, n] | q[2j+1, n] << 4, q in 0..15
      scales  [K/g, N]      compute dtype
      zeros   [K/g, N]      compute dtype (a float: GGUF's minimums are not integers)
      perm    i32[K]        only with act_order (GPTQ desc_act): y = x[:, perm] @ w
      w[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]
  weights "int8" | "fp8", activations None (W8A16):
      qweight i8[K, N] | float8_e4m3fn[K, N], scales [K/g, N] (compute dtype); w = q * scales[k // g]
  weights "int8" | "fp8", activations "int8" | "fp8" (W8A8):
      qweight i8[N, K] | float8_e4m3fn[N, K] (out, in: as the checkpoints store it), weight_scale f32[N]
      (per output channel), and with static_input_scale an input_scale f32[] (else activations are
      quantized per token, dynamically). [N, K] keeps K contiguous: cuBLASLt's FP8 GEMM takes
      both operands K-major (its "TN" layout), and from a [K, N] weight XLA transposes the whole weight
      on every call, which makes the W8A8 GEMM slower than the bf16 one it replaces. (The weight-only
      layouts keep [K, N]: their codes become the compute dtype before a float GEMM.)

Embeddings and the LM head stay in the compute dtype (as in vLLM for these methods).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

WEIGHT_KINDS = ("int4", "int8", "fp8")
ACTIVATION_KINDS = (None, "int8", "fp8")
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# leaves kept in float32 whatever the model's dtype: the W8A8 scales multiply an f32 accumulator
FLOAT32_LEAVES = ("weight_scale", "input_scale", "k_scale", "v_scale")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    method: str  # what the user or config.json named: "fp8", "awq", "gptq", "compressed-tensors", "gguf"
    weights: str  # "int4" | "int8" | "fp8"
    activations: str | None = None  # None (weight-only) | "int8" | "fp8"
    group_size: int | None = None  # None: one scale per output channel
    act_order: bool = False  # GPTQ's desc_act / compressed-tensors' actorder "group": a perm leaf
    static_input_scale: bool = False  # W8A8 with the checkpoint's per-tensor input scale
    online: bool = False  # a float checkpoint quantized at load (--quantization fp8)
    # how the checkpoint packs the weights (jaxllm/quantization/checkpoint_formats.py): "awq", "gptq",
    # "gptq_v2", "compressed-tensors" (8-bit weights as stored), "pack-quantized" (compressed-tensors int4/int8
    # codes in int32), "fp8"; None for float weights (online, random, GGUF)
    packing: str | None = None
    symmetric: bool = True  # the checkpoint stores no zero points (compressed-tensors) or constant ones

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_KINDS:
            raise ValueError(f"weights={self.weights!r} must be one of {WEIGHT_KINDS}")
        if self.activations not in ACTIVATION_KINDS:
            raise ValueError(f"activations={self.activations!r} must be one of {ACTIVATION_KINDS}")
        if self.activations is not None and (self.weights == "int4" or self.group_size is not None):
            raise ValueError(
                f"{self.method}: activations={self.activations!r} needs 8-bit weights with one scale per "
                f"output channel, not weights={self.weights!r} with group_size={self.group_size}"
            )
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"{self.method}: group_size={self.group_size} must be an even number >= 2")
        if self.act_order and self.weights != "int4":
            raise ValueError(f"{self.method}: act_order applies to int4 weights only")

    @property
    def weight_only(self) -> bool:
        return self.activations is None

    def describe(self) -> str:
        """A short name for logs: "fp8 W8A8 (dynamic per-token)", "int4 W4A16 g128 act-order"."""
        bits = {"int4": "4", "int8": "8", "fp8": "8"}[self.weights]
        name = f"{self.method}: {self.weights} W{bits}A" + ("16" if self.weight_only else "8")
        if self.group_size:
            name += f" g{self.group_size}"
        if self.act_order:
            name += " act-order"
        if not self.weight_only:
            name += " (static input scale)" if self.static_input_scale else " (dynamic per-token)"
        if self.online:
            name += ", quantized at load"
        return name

    def group(self, in_features: int) -> int:
        """The group size g for a layer with `in_features` inputs; ValueError when g does not divide it."""
        g = self.group_size or in_features
        if in_features % g:
            raise ValueError(
                f"{self.method}: group_size={g} does not divide a linear layer's {in_features} input features"
            )
        return g

    def param_shapes(self, in_features: int, out_features: int, dtype) -> dict[str, tuple[tuple, object]]:
        """{leaf name: (shape, dtype)} of one linear layer's quantized weight (the layout above)."""
        k, n = in_features, out_features
        if self.weights == "int4":
            if k % 2:
                raise ValueError(f"{self.method}: int4 weights need an even number of inputs, got {k}")
            groups = k // self.group(k)
            shapes = {
                "qweight": ((k // 2, n), jnp.uint8),
                "scales": ((groups, n), dtype),
                "zeros": ((groups, n), dtype),
            }
            if self.act_order:
                shapes["perm"] = ((k,), jnp.int32)
            return shapes
        qdtype = jnp.int8 if self.weights == "int8" else FP8_DTYPE
        if self.weight_only:
            return {"qweight": ((k, n), qdtype), "scales": ((k // self.group(k), n), dtype)}
        shapes = {"qweight": ((n, k), qdtype), "weight_scale": ((n,), jnp.float32)}
        if self.static_input_scale:
            shapes["input_scale"] = ((), jnp.float32)
        return shapes


@dataclass(frozen=True, slots=True)
class LayerQuant:
    """The schemes of one decoder layer's projections: `default` for each, unless `overrides` names the
    projection ("qkv_proj", "down_proj", ...; None there: that one stays in the compute dtype). A GGUF
    file, whose types vary by tensor, gives every layer its own; other checkpoints one for all layers.
    Layers with equal LayerQuants share one trace (jaxllm/models/layer_trace.py)."""

    default: QuantScheme | None = None
    overrides: tuple[tuple[str, QuantScheme | None], ...] = ()

    def get(self, projection: str) -> QuantScheme | None:
        for name, scheme in self.overrides:
            if name == projection:
                return scheme
        return self.default


def online_fp8() -> QuantScheme:
    """`--quantization fp8` on a float checkpoint: vLLM's dynamic FP8 (per-channel weight scales, per-token
    activation scales)."""
    return QuantScheme("fp8", "fp8", "fp8", online=True)
