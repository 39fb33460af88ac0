"""`quantized_matmul` of every canonical layout against dequantize-then-matmul in numpy float64, and the
quantizers' round-trip error bounds.

The reference reads the canonical layout from its definition (jaxllm/quantization/scheme.py's docstring)
without jaxllm's code: unpack the bytes, subtract the zero points, scale, permute x; for W8A8 it quantizes
x per token (or with the static scale) in float32 exactly as documented in jaxllm/layers/linear.py, so
only the accumulation order and the output's rounding differ.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.layers.linear import QuantizedLinear, dequantize, quantized_matmul
from jaxllm.quantization.quantize import quantize_fp8, quantize_int4, quantize_int8
from jaxllm.quantization.scheme import QuantScheme

T, K, N = 7, 256, 64
DTYPES = {"float32": (jnp.float32, 2e-6), "bfloat16": (jnp.bfloat16, 2**-7)}  # dtype, error / |x|@|w|


def ref_weight(params: dict, scheme: QuantScheme) -> np.ndarray:
    """f64[K, N] from the canonical leaves, by the layout's definition."""
    q = np.asarray(params["qweight"])
    if not scheme.weight_only:  # W8A8: qweight [N, K], one scale per output row
        return (q.astype(np.float64) * np.asarray(params["weight_scale"], np.float64)[:, None]).T
    if scheme.weights == "int4":
        codes = np.empty((q.shape[0] * 2, q.shape[1]), np.float64)
        codes[0::2] = q & 0xF  # byte j of column n = q[2j, n] | q[2j + 1, n] << 4
        codes[1::2] = q >> 4
    else:
        codes = q.astype(np.float64)  # int8, or fp8 through ml_dtypes
    scales = np.asarray(params["scales"].astype(jnp.float32), np.float64)
    g = codes.shape[0] // scales.shape[0]
    rows = np.arange(codes.shape[0]) // g
    if scheme.weights == "int4":
        codes = codes - np.asarray(params["zeros"].astype(jnp.float32), np.float64)[rows]
    return codes * scales[rows]


def ref_activations(x: np.ndarray, kind: str, input_scale) -> tuple[np.ndarray, np.ndarray]:
    """(x_q f64[T, K], s_x f64[T, 1]): per token s = max|x| / qmax (or the static scale), in float32."""
    qmax = np.float32(448.0 if kind == "fp8" else 127.0)
    xf = x.astype(np.float32)
    if input_scale is None:
        s = np.maximum(np.abs(xf).max(axis=1, keepdims=True), np.float32(1e-12)) / qmax
    else:
        s = np.full((x.shape[0], 1), np.float32(input_scale), np.float32)
    xs = np.clip(xf / s, -qmax, qmax)
    xq = xs.astype(ml_dtypes.float8_e4m3fn) if kind == "fp8" else np.round(xs).astype(np.int8)
    return xq.astype(np.float64), s.astype(np.float64)


def reference(x, params: dict, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """(y f64[T, N], the size |x| @ |w| of each output, for the tolerance)."""
    x = np.asarray(x.astype(jnp.float32), np.float64)
    if "perm" in params:
        x = x[:, np.asarray(params["perm"])]
    w = ref_weight(params, scheme)
    if scheme.weight_only:
        return x @ w, np.abs(x) @ np.abs(w)
    xq, s = ref_activations(x, scheme.activations, params.get("input_scale"))
    return (xq @ w) * s, (np.abs(xq) @ np.abs(w)) * s


def random_params(rng, scheme: QuantScheme, dtype) -> dict:
    shapes = scheme.param_shapes(K, N, dtype)
    out = {}
    for name, (shape, dt) in shapes.items():
        if name == "qweight" and dt == jnp.uint8:
            out[name] = jnp.asarray(rng.integers(0, 256, shape), jnp.uint8)
        elif name == "qweight" and dt == jnp.int8:
            out[name] = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        elif name == "qweight":
            out[name] = jnp.asarray(np.clip(rng.standard_normal(shape) * 100, -448, 448), dt)
        elif name == "zeros":  # a float layout: GGUF's minimums are not integers
            out[name] = jnp.asarray(rng.uniform(0, 15, shape), dt)
        elif name == "perm":
            out[name] = jnp.asarray(rng.permutation(K), jnp.int32)
        elif name == "input_scale":
            out[name] = jnp.asarray(0.01, jnp.float32)
        else:  # scales, weight_scale
            out[name] = jnp.asarray(rng.uniform(0.5, 1.5, shape) / K, dt)
    return out


LAYOUTS = {
    "int4 g32": QuantScheme("t", "int4", group_size=32),
    "int4 per-channel": QuantScheme("t", "int4"),
    "int4 g64 act-order": QuantScheme("t", "int4", group_size=64, act_order=True),
    "int8 W8A16 per-channel": QuantScheme("t", "int8"),
    "int8 W8A16 g64": QuantScheme("t", "int8", group_size=64),
    "fp8 W8A16 per-channel": QuantScheme("t", "fp8"),
    "fp8 W8A16 g128": QuantScheme("t", "fp8", group_size=128),
    "int8 W8A8 dynamic": QuantScheme("t", "int8", "int8"),
    "int8 W8A8 static": QuantScheme("t", "int8", "int8", static_input_scale=True),
    "fp8 W8A8 dynamic": QuantScheme("t", "fp8", "fp8"),
    "fp8 W8A8 static": QuantScheme("t", "fp8", "fp8", static_input_scale=True),
}


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quantized_matmul_matches_dequantize_then_matmul(layout, dtype_name):
    dtype, rel = DTYPES[dtype_name]
    scheme = LAYOUTS[layout]
    rng = np.random.default_rng(len(layout))
    params = random_params(rng, scheme, dtype)
    x = jnp.asarray(rng.standard_normal((T, K)), dtype)
    x = x.at[0].set(0.0)  # an all-zero (padding) row: the per-token scale must not divide by zero
    y = quantized_matmul(x, params, scheme)
    assert y.dtype == dtype and y.shape == (T, N)
    want, size = reference(x, params, scheme)
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - want)
    assert np.all(err <= rel * size + 1e-30), f"{layout} {dtype_name}: worst {np.max(err / (size + 1e-30))}"
    assert np.all(np.asarray(y[0]) == 0)
    if "perm" in params:  # the check can fail: without the permutation of x the product is far off
        wrong = reference(x, {k: v for k, v in params.items() if k != "perm"}, scheme)[0]
        assert np.max(np.abs(wrong - want)[1:] / size[1:]) > 10 * rel


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["int8 W8A8 dynamic", "fp8 W8A8 static"])
def test_w8a8_weight_only_is_x_times_the_dequantized_weight(layout, dtype_name):
    """The decode-batch path of a W8A8 layer leaves x unquantized: x @ the layer's weight up to the dtype's
    rounding, where the W8A8 path's per-token 8-bit activations are further off (the check can fail)."""
    dtype, rel = DTYPES[dtype_name]
    scheme = LAYOUTS[layout]
    rng = np.random.default_rng(11)
    params = random_params(rng, scheme, dtype)
    x = jnp.asarray(rng.standard_normal((T, K)), dtype)
    y = quantized_matmul(x, params, scheme, w8a8_weight_only=True)
    assert y.dtype == dtype and y.shape == (T, N)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    w = ref_weight(params, scheme)
    want, size = xf @ w, np.abs(xf) @ np.abs(w)
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - want)
    assert np.all(err <= 2 * rel * size), f"worst {np.max(err / size)}"
    if dtype == jnp.float32:
        w8a8 = np.asarray(quantized_matmul(x, params, scheme), np.float64)
        assert np.max(np.abs(w8a8 - want) / size) > 100 * rel


@pytest.mark.parametrize("use_kernels", [False, True])
def test_quantized_linear_leaves_decode_batches_unquantized_on_the_gpu(use_kernels, monkeypatch):
    """With use_kernels (a GPU backend) a W8A8 layer takes the weight-only path up to
    W8A8_WEIGHT_ONLY_MAX_ROWS tokens and quantizes activations above; without, it always quantizes."""
    from jaxllm.layers import linear as linear_mod

    monkeypatch.setattr(linear_mod, "W8A8_WEIGHT_ONLY_MAX_ROWS", T)
    scheme = LAYOUTS["fp8 W8A8 dynamic"]
    layer = QuantizedLinear(N, scheme, use_kernels=use_kernels)
    rng = np.random.default_rng(12)
    params = random_params(rng, scheme, jnp.float32)
    for rows in (T, T + 1):
        x = jnp.asarray(rng.standard_normal((rows, K)), jnp.float32)
        y = np.asarray(layer.apply({"params": params}, x))
        weight_only = use_kernels and rows <= T
        want = quantized_matmul(x, params, scheme, w8a8_weight_only=weight_only)
        other = quantized_matmul(x, params, scheme, w8a8_weight_only=not weight_only)
        np.testing.assert_allclose(y, np.asarray(want), rtol=1e-6, atol=1e-9)
        assert not np.allclose(y, np.asarray(other), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("layout", ["int4 g64 act-order", "int8 W8A16 g64", "fp8 W8A8 dynamic"])
def test_dequantize_is_the_layout(layout):
    scheme = LAYOUTS[layout]
    params = random_params(np.random.default_rng(1), scheme, jnp.float32)
    np.testing.assert_allclose(
        np.asarray(dequantize(params, scheme, jnp.float32)), ref_weight(params, scheme), rtol=1e-6, atol=1e-9
    )


def test_static_input_scale_clips():
    """Static W8A8: activations beyond qmax * input_scale saturate (they are not rescaled per token)."""
    scheme = LAYOUTS["int8 W8A8 static"]
    params = random_params(np.random.default_rng(2), scheme, jnp.float32)
    x = jnp.full((1, K), 5.0, jnp.float32)  # 5 / 0.01 = 500 > 127: every input saturates at 1.27
    y = np.asarray(quantized_matmul(x, params, scheme))
    w = ref_weight(params, scheme)
    np.testing.assert_allclose(y[0], 1.27 * w.sum(axis=0), rtol=1e-5)


def test_quantized_linear_module():
    """The flax module declares the scheme's leaves and adds its bias to quantized_matmul's product."""
    scheme = LAYOUTS["int4 g32"]
    layer = QuantizedLinear(N, scheme, use_bias=True)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((T, K)), jnp.float32)
    shapes = jax_shapes(layer.init(jax_key(), x)["params"])
    assert shapes == {**{k: s for k, (s, _) in scheme.param_shapes(K, N, jnp.float32).items()}, "bias": (N,)}
    params = random_params(np.random.default_rng(4), scheme, jnp.float32)
    bias = jnp.arange(N, dtype=jnp.float32)
    y = layer.apply({"params": {**params, "bias": bias}}, x)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(quantized_matmul(x, params, scheme) + bias), rtol=1e-6
    )


HLO_TYPES = {"fp8": "f8E4M3FN", "int8": "i8"}


@pytest.mark.parametrize("layout", ["fp8 W8A8 dynamic", "int8 W8A8 static"])
def test_w8a8_layer_contracts_the_weight_in_place(layout):
    """The W8A8 weight is held [N, K] and the jitted layer contracts its last axis, with no transpose: the
    layout cuBLASLt's FP8 GEMM takes (K contiguous in both operands). A [K, N] weight would lower to
    contracting dims [1] x [0], which XLA on the GPU turns into a transpose of the weight every call."""
    import jax

    scheme = LAYOUTS[layout]
    layer = QuantizedLinear(N, scheme)
    x = jax.ShapeDtypeStruct((T, K), jnp.bfloat16)
    params = jax.eval_shape(layer.init, jax_key(), x)
    assert params["params"]["qweight"].shape == (N, K)
    hlo = jax.jit(layer.apply).lower(params, x).as_text()
    signature = re.search(r"func\.func public @main\((.*?)\) ->", hlo).group(1)
    weight = re.findall(rf"(%arg\d+): tensor<{N}x{K}x{HLO_TYPES[scheme.weights]}>", signature)
    assert len(weight) == 1, signature
    dots = re.findall(
        rf"stablehlo\.dot_general %\w+, {weight[0]}, contracting_dims = \[(\d+)\] x \[(\d+)\]", hlo
    )
    assert dots == [("1", "1")], hlo
    assert not re.search(rf"stablehlo\.transpose {weight[0]}\b", hlo)


def jax_key():
    import jax

    return jax.random.key(0)


def jax_shapes(tree: dict) -> dict:
    return {k: tuple(v.shape) for k, v in tree.items()}


# --- quantizers: round trip within the format's rounding bound ------------------------------------------


def offset_weights(rng, k=K, n=N) -> np.ndarray:
    """Mostly zero-centred columns, some shifted so that a group is all positive or all negative."""
    w = rng.standard_normal((k, n)) * 0.05
    w[:, :8] += 0.3
    w[:, 8:16] -= 0.2
    return w.astype(np.float32)


def test_quantize_fp8_round_trip():
    w = offset_weights(np.random.default_rng(5))
    p = quantize_fp8(jnp.asarray(w))
    assert p["qweight"].shape == (N, K)  # W8A8's layout
    colmax = np.abs(w).max(axis=0)
    np.testing.assert_allclose(np.asarray(p["weight_scale"]), colmax / 448, rtol=1e-6)
    back = np.asarray(dequantize(p, QuantScheme("fp8", "fp8", "fp8"), jnp.float32))
    err = np.abs(back - w)
    assert np.all(err <= 2**-4 * colmax[None, :]), np.max(err / colmax)
    # finer: e4m3 keeps 3 mantissa bits, so each value is within 2^-4 of itself (subnormals: 2^-10 scale)
    assert np.all(err <= 2**-4 * np.abs(w) + 2**-10 * np.asarray(p["weight_scale"])[None, :] * 1.0001)


@pytest.mark.parametrize("group", [None, 32])
def test_quantize_int8_round_trip(group):
    w = offset_weights(np.random.default_rng(6))
    g = group or K
    p = quantize_int8(jnp.asarray(w), group)
    back = np.asarray(dequantize(p, QuantScheme("t", "int8", group_size=group), jnp.float32))
    gmax = np.repeat(np.abs(w.reshape(K // g, g, N)).max(axis=1), g, axis=0)  # [K, N]
    assert np.all(np.abs(back - w) <= gmax / 254 * (1 + 1e-5))
    if group is None:
        p8 = quantize_int8(jnp.asarray(w), w8a8=True)  # the same codes, held [N, K]
        np.testing.assert_array_equal(np.asarray(p8["qweight"]), np.asarray(p["qweight"]).T)
        assert p8["weight_scale"].shape == (N,) and p8["weight_scale"].dtype == jnp.float32


@pytest.mark.parametrize("group", [32, 128])
def test_quantize_int4_round_trip(group):
    w = offset_weights(np.random.default_rng(7))
    p = quantize_int4(jnp.asarray(w), group)
    back = np.asarray(dequantize(p, QuantScheme("t", "int4", group_size=group), jnp.float32))
    assert np.all(np.asarray(p["zeros"]) == np.round(np.asarray(p["zeros"])))  # integers, as AWQ/GPTQ store
    blocks = w.reshape(K // group, group, N)
    # the range of each group, widened to include 0 (the integer zero point must be a code); columns 0..16
    # are all positive or all negative, the others straddle 0, where this is the plain group range
    lo, hi = np.minimum(blocks.min(axis=1), 0), np.maximum(blocks.max(axis=1), 0)
    grange = np.repeat(hi - lo, group, axis=0)  # [K, N]
    err = np.abs(back - w)
    assert np.all(err <= grange / 30 * (1 + 1e-4)), np.max(err / grange)
    assert np.all(blocks[:, :, 16:].min(axis=1) < 0) and np.all(blocks[:, :, 16:].max(axis=1) > 0)


def test_w4a16_kernel_only_without_a_mesh(monkeypatch):
    """use_kernels lets small batches run a Pallas W4A16 kernel (the matrix-vector one up to
    W4A16_GEMV_MAX_ROWS rows, else the GEMM), but not under a tensor-parallel mesh (the kernels see whole
    arrays) nor above W4A16_KERNEL_MAX_ROWS rows; those dequantize, then dot."""
    import sys
    import types

    import jax
    from jax.sharding import AbstractMesh

    from jaxllm.layers.linear import W4A16_GEMV_MAX_ROWS, W4A16_KERNEL_MAX_ROWS

    calls = []
    for kernel in ("w4a16_matmul", "w4a16_gemv"):
        fake = types.ModuleType(f"jaxllm.kernels.{kernel}")
        setattr(fake, kernel, lambda x, qweight, scales, zeros, kernel=kernel: (
            calls.append((kernel, x.shape)) or jnp.zeros((x.shape[0], qweight.shape[1]), x.dtype)
        ))  # fmt: skip
        monkeypatch.setitem(sys.modules, f"jaxllm.kernels.{kernel}", fake)
    scheme = LAYOUTS["int4 g32"]
    layer = QuantizedLinear(N, scheme, use_kernels=True)
    params = {"params": random_params(np.random.default_rng(8), scheme, jnp.float32)}
    small = jax.ShapeDtypeStruct((4, K), jnp.float32)
    one = jax.ShapeDtypeStruct((W4A16_GEMV_MAX_ROWS, K), jnp.float32)
    jax.eval_shape(layer.apply, params, small)
    jax.eval_shape(layer.apply, params, one)
    assert calls == [("w4a16_matmul", (4, K)), ("w4a16_gemv", (W4A16_GEMV_MAX_ROWS, K))]
    jax.eval_shape(layer.apply, params, jax.ShapeDtypeStruct((W4A16_KERNEL_MAX_ROWS + 1, K), jnp.float32))
    with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("tp",))):
        jax.eval_shape(layer.apply, params, small)
        jax.eval_shape(layer.apply, params, one)
    assert len(calls) == 2
