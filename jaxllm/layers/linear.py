"""`linear(...)`: the models' projection layer, plain or quantized by a `QuantScheme`.

Without a scheme it is `nn.Dense` (the same "kernel"/"bias" params and numerics). With one,
`QuantizedLinear` declares
the scheme's leaves (jaxllm/quantization/scheme.py) and computes:

  W8A8 (fp8 | int8)   x -> per-token scale s_x = max|x| / qmax (or the static input_scale) -> x_q ->
                      x_q [T, K] . qweight [N, K], contracting the last axis of both, accumulated in f32
                      (fp8: cuBLASLt's FP8 GEMM on Hopper; int8: an int32 GEMM) ->
                      * s_x[:, None] * weight_scale[None, :]. The FP8 GEMM takes both operands with K
                      contiguous; a [K, N] weight would cost a transpose of the whole weight per call.
                      At decode batch sizes (up to W8A8_WEIGHT_ONLY_MAX_ROWS tokens, on the GPU) the GEMM
                      is bound by reading the weight, and the per-token quantization's extra kernels cost
                      more than the 8-bit arithmetic saves: x stays in its dtype and the 8-bit weight is
                      converted in the GEMM (XLA fuses the convert into its Triton GEMM's operand load),
                      so the bytes read still halve; * weight_scale after.
  W8A16               per-channel: dot(x, qweight as x.dtype) * scales (the scale after the GEMM, which
                      XLA fuses with the convert); grouped: dequantize, then dot
  W4A16               on the GPU, small batches run a Pallas kernel that reads the 4-bit weight once and
                      dequantizes in registers: one row the matrix-vector kernel on the CUDA cores
                      (jaxllm/kernels/w4a16_gemv.py), more the GEMM (jaxllm/kernels/w4a16_matmul.py);
                      otherwise (prefill, the CPU, a mesh) dequantize, then dot, where the dequantization
                      is paid once per GEMM

The plain-jnp `dequantize` of each layout is what tests compare against.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.kernels.int4_reference import unpack_int4
from jaxllm.layers.tensor_parallel import current_tp_mesh
from jaxllm.quantization.scheme import FP8_DTYPE, FP8_MAX, QuantScheme

INT8_MAX = 127.0


def dequantize(params: dict, scheme: QuantScheme, dtype) -> jax.Array:
    """The float weight [K, N] a layer's quantized leaves stand for (rows in perm order with act_order)."""
    q = params["qweight"]
    if not scheme.weight_only:  # qweight [N, K]
        return (q.T.astype(jnp.float32) * params["weight_scale"][None, :]).astype(dtype)
    if scheme.weights == "int4":
        q = unpack_int4(q)
    k, n = q.shape
    scales = params["scales"].astype(dtype)
    g = k // scales.shape[0]
    w = q.astype(dtype).reshape(k // g, g, n)
    if scheme.weights == "int4":
        w = w - params["zeros"].astype(dtype)[:, None, :]
    return (w * scales[:, None, :]).reshape(k, n)


def quantize_activations(x: jax.Array, kind: str, input_scale: jax.Array | None):
    """(x_q [T, K], s_x f32[T, 1]): per-token symmetric scales, or the static per-tensor one."""
    qmax, qdtype = (FP8_MAX, FP8_DTYPE) if kind == "fp8" else (INT8_MAX, jnp.int8)
    xf = x.astype(jnp.float32)
    if input_scale is None:
        s = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / qmax
    else:
        s = jnp.broadcast_to(input_scale.astype(jnp.float32), (x.shape[0], 1))
    xs = jnp.clip(xf / s, -qmax, qmax)
    if kind == "int8":
        xs = jnp.round(xs)
    return xs.astype(qdtype), s


def w8a8_weight_only_matmul(x: jax.Array, params: dict) -> jax.Array:
    """y [T, N] = x [T, K] . the W8A8 layer's dequantized weight, x not quantized: the 8-bit qweight [N, K]
    converted to x's dtype (contracting the last axis of both), then the per-channel weight_scale."""
    dtype = x.dtype
    y = jax.lax.dot_general(x, params["qweight"].astype(dtype), (((x.ndim - 1,), (1,)), ((), ())))
    return y * params["weight_scale"].astype(dtype)[None, :]


def quantized_matmul(
    x: jax.Array, params: dict, scheme: QuantScheme, use_kernel: bool = False, w8a8_weight_only: bool = False
) -> jax.Array:
    """y [T, N] = x [T, K] @ the layer's weight, in x's dtype. `w8a8_weight_only`: a W8A8 layer leaves x
    unquantized (decode batches on the GPU, see the module docstring)."""
    dtype = x.dtype
    if "perm" in params:
        x = jnp.take(x, params["perm"], axis=-1)
    if not scheme.weight_only and w8a8_weight_only:
        return w8a8_weight_only_matmul(x, params)
    if not scheme.weight_only:
        xq, sx = quantize_activations(x, scheme.activations, params.get("input_scale"))
        acc_type = jnp.int32 if scheme.activations == "int8" else jnp.float32
        # xq [T, K] . qweight [N, K] -> [T, N]: both operands K-contiguous, as cuBLASLt's FP8 GEMM takes them
        acc = jax.lax.dot_general(
            xq, params["qweight"], (((xq.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc_type
        ).astype(jnp.float32)
        return (acc * sx * params["weight_scale"][None, :]).astype(dtype)
    if scheme.weights == "int4" and use_kernel and w4a16_kernel_fits(params):
        if x.shape[0] <= W4A16_GEMV_MAX_ROWS:
            from jaxllm.compat import pipeline_named_triton_loops
            from jaxllm.kernels.w4a16_gemv import w4a16_gemv as kernel

            pipeline_named_triton_loops()  # what the GEMV's `pipeline` knob asks for (its docstring)
        else:
            from jaxllm.kernels.w4a16_matmul import w4a16_matmul as kernel
        return kernel(x, params["qweight"], params["scales"], params["zeros"])
    if scheme.weights != "int4" and params["scales"].shape[0] == 1:
        # as nn.Dense: a dot in x's dtype (GPUs accumulate half precision in f32 inside the GEMM; XLA's
        # CPU has no bf16 x bf16 -> f32 dot)
        return jnp.dot(x, params["qweight"].astype(dtype)) * params["scales"][0].astype(dtype)
    w = dequantize(params, scheme, dtype)
    return jnp.dot(x, w)


def w4a16_kernel_fits(params: dict) -> bool:
    """The Pallas GEMM's shape limits: groups of a multiple of 32 inputs, N a multiple of 16 (two and one
    of Triton's smallest dot operands); other layers dequantize, then dot."""
    k, n = params["qweight"].shape[0] * 2, params["qweight"].shape[1]
    g = k // params["scales"].shape[0]
    return g % 32 == 0 and n % 16 == 0


# Rows up to which the W4A16 Pallas GEMM beats dequantize-then-dot (decode batches); above it the
# dequantized tile is reused by enough rows that XLA's GEMM wins.
W4A16_KERNEL_MAX_ROWS = 256
# Rows up to which the matrix-vector kernel (jaxllm/kernels/w4a16_gemv.py, CUDA cores) beats the GEMM
# kernel: one decoding sequence (its step has a bucket of one token: jaxllm/runner/buckets.py). At the
# next bucket, 8 rows, the GEMM kernel is faster (benchmarks/w4a16_matmul.py; docs/performance.md).
W4A16_GEMV_MAX_ROWS = 1
# Rows up to which a W8A8 layer on the GPU leaves the activations unquantized (decode batches, where the
# GEMM reads the weight once and the activation quantization's kernels are overhead).
W8A8_WEIGHT_ONLY_MAX_ROWS = 64


class QuantizedLinear(nn.Module):
    features: int
    quant: QuantScheme
    use_bias: bool = False
    # on the GPU (a GPU attention backend): the W4A16 Pallas GEMM may run (no mesh), W8A8 decode batches
    # leave the activations unquantized
    use_kernels: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, K] -> [T, N]
        # float leaves are declared float32 and take the model's dtype in the loader's abstract tree
        # (jaxllm/models/registry.py), except the W8A8 scales, which stay float32
        shapes = self.quant.param_shapes(x.shape[-1], self.features, jnp.float32)
        params = {
            name: self.param(name, nn.initializers.zeros_init(), s, d) for name, (s, d) in shapes.items()
        }
        # the Pallas GEMM sees whole arrays: under a tensor-parallel mesh XLA's partitioner, which cannot
        # split a custom call, would gather every shard's weight to each device, so a mesh dequantizes
        use_kernel = self.use_kernels and x.shape[0] <= W4A16_KERNEL_MAX_ROWS and current_tp_mesh() is None
        weight_only = self.use_kernels and x.shape[0] <= W8A8_WEIGHT_ONLY_MAX_ROWS
        y = quantized_matmul(x, params, self.quant, use_kernel, weight_only)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32).astype(
                y.dtype
            )
        return y


def linear(features: int, use_bias: bool, quant: QuantScheme | None, name: str, use_kernels: bool = False):
    """The projection `name`: nn.Dense (params kernel [K, N], bias) without a scheme, else QuantizedLinear."""
    if quant is None:
        return nn.Dense(features, use_bias=use_bias, name=name)
    return QuantizedLinear(features, quant, use_bias, use_kernels, name=name)
