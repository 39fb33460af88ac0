"""Each checkpoint packing -> jaxllm's canonical leaves, checked by dequantizing (jaxllm.layers.linear's
`dequantize`) against the float weight the test computed from its own codes, scales and zeros.

The packed tensors come from tests/quantization/packers.py (written from the formats' definitions, not
from jaxllm), with random codes, and one hand-computed int32 per packing pins the bit order itself.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxllm.layers.linear import dequantize
from jaxllm.quantization.checkpoint_formats import packing_for
from jaxllm.quantization.scheme import QuantScheme
from tests.quantization import packers

K, N = 256, 64


def convert(scheme: QuantScheme, tensors: dict) -> dict:
    return packing_for(scheme).convert(tensors, "ckpt: model.layers.0.mlp.up_proj")


def restored(leaves: dict, scheme: QuantScheme) -> np.ndarray:
    """The [K, N] float weight in the checkpoint's own row order (undoing an act-order perm)."""
    w = np.asarray(dequantize(leaves, scheme, np.float32))
    if "perm" in leaves:
        back = np.empty_like(w)
        back[np.asarray(leaves["perm"])] = w
        return back
    return w


@pytest.mark.parametrize("g", [32, 128])
def test_awq(g):
    rng = np.random.default_rng(g)
    q, z, s = packers.random_int4(rng, K, N, g)
    scheme = QuantScheme("awq", "int4", group_size=g, packing="awq")
    leaves = convert(scheme, packers.awq_checkpoint(q, z, s))
    assert set(leaves) == {"qweight", "scales", "zeros"}
    want = packers.int4_weight(q, z, s, np.arange(K) // g)
    np.testing.assert_array_equal(restored(leaves, scheme), want)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("g", [32, None])
def test_gptq(version, act_order, g):
    rng = np.random.default_rng(version * 10 + act_order)
    gs = g or K
    q, z, s = packers.random_int4(rng, K, N, gs, zero_low=1)
    g_idx = packers.act_order_g_idx(rng, K, gs) if act_order else np.arange(K) // gs
    fmt = "gptq" if version == 1 else "gptq_v2"
    scheme = QuantScheme("gptq", "int4", group_size=g, act_order=act_order, packing=fmt, symmetric=False)
    leaves = convert(scheme, packers.gptq_checkpoint(q, z, s, g_idx, version))
    assert ("perm" in leaves) == act_order
    want = packers.int4_weight(q, z, s, g_idx)
    np.testing.assert_array_equal(restored(leaves, scheme), want)
    if act_order and g:
        # the canonical rows are in group order: group j is rows j*g .. (j+1)*g of the sorted weight
        perm = np.asarray(leaves["perm"])
        np.testing.assert_array_equal(g_idx[perm], np.arange(K) // g)


def test_gptq_act_order_groups_must_be_whole():
    rng = np.random.default_rng(0)
    q, z, s = packers.random_int4(rng, K, N, 32, zero_low=1)
    g_idx = np.arange(K) // 32
    g_idx[0] = 1  # group 1 now has 33 rows
    scheme = QuantScheme("gptq", "int4", group_size=32, act_order=True, packing="gptq")
    with pytest.raises(ValueError, match="up_proj: g_idx"):
        convert(scheme, packers.gptq_checkpoint(q, z, s, g_idx))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_compressed_tensors_pack_quantized_int4(symmetric, act_order):
    rng = np.random.default_rng(symmetric * 2 + act_order)
    g = 32
    q = rng.integers(-8, 8, size=(N, K))  # signed codes, torch layout [N, K]
    s = rng.uniform(0.005, 0.05, size=(N, K // g)).astype(np.float16).astype(np.float32)
    zp = None if symmetric else rng.integers(-8, 8, size=(N, K // g))
    g_idx = packers.act_order_g_idx(rng, K, g) if act_order else np.arange(K) // g
    scheme = QuantScheme(
        "compressed-tensors", "int4", group_size=g, act_order=act_order, packing="pack-quantized",
        symmetric=symmetric,
    )  # fmt: skip
    tensors = packers.ct_pack_quantized(q, s, zp, g_idx if act_order else None)
    leaves = convert(scheme, tensors)
    zeros = np.zeros_like(s) if zp is None else zp
    want = ((q - zeros[:, g_idx]) * s[:, g_idx]).T.astype(np.float32)  # [K, N]
    np.testing.assert_array_equal(restored(leaves, scheme), want)


def test_compressed_tensors_pack_quantized_int8_channel():
    """llm-compressor's W8A16: 8-bit codes, four per int32 (code + 128), one scale per output channel."""
    rng = np.random.default_rng(3)
    q = rng.integers(-128, 128, size=(N, K))
    s = rng.uniform(0.001, 0.01, size=(N, 1)).astype(np.float16).astype(np.float32)
    scheme = QuantScheme("compressed-tensors", "int8", packing="pack-quantized")
    leaves = convert(scheme, packers.ct_pack_quantized(q, s, bits=8))
    assert leaves["qweight"].dtype == np.int8 and leaves["qweight"].shape == (K, N)
    np.testing.assert_array_equal(restored(leaves, scheme), (q * s).T.astype(np.float32))


def test_compressed_tensors_pack_quantized_pads_k():
    """K not a multiple of 8: the last int32 of each row is padded, weight_shape says the real K."""
    rng = np.random.default_rng(4)
    n, k = 16, 20
    q = rng.integers(-8, 8, size=(n, k))
    s = rng.uniform(0.01, 0.02, size=(n, 1)).astype(np.float16).astype(np.float32)
    scheme = QuantScheme("compressed-tensors", "int4", packing="pack-quantized")
    tensors = packers.ct_pack_quantized(q, s)
    assert tensors["weight_packed"].shape == (n, 3)
    np.testing.assert_array_equal(restored(convert(scheme, tensors), scheme), (q * s).T.astype(np.float32))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("w8a8", [False, True])
def test_compressed_tensors_eight_bit(strategy, kind, w8a8):
    rng = np.random.default_rng(5)
    if kind == "int8":
        w = rng.integers(-127, 128, size=(N, K)).astype(np.int8)
    else:
        w = packers.fp8_codes(rng, N, K)
    shape = (N, 1) if strategy == "channel" else (1,)
    s = rng.uniform(0.001, 0.01, size=shape).astype(np.float32)
    scheme = QuantScheme("compressed-tensors", kind, kind if w8a8 else None, packing="compressed-tensors")
    leaves = convert(scheme, {"weight": w, "weight_scale": s})
    assert ("weight_scale" in leaves) == w8a8
    # W8A8 keeps the checkpoint's [N, K] (K contiguous for the FP8 GEMM), weight-only is [K, N]
    assert leaves["qweight"].shape == ((N, K) if w8a8 else (K, N))
    want = (w.astype(np.float32) * s.reshape(-1, 1)).T
    np.testing.assert_allclose(restored(leaves, scheme), want, rtol=1e-7)


def test_compressed_tensors_int8_group_scales():
    rng = np.random.default_rng(6)
    g = 64
    w = rng.integers(-127, 128, size=(N, K)).astype(np.int8)
    s = rng.uniform(0.001, 0.01, size=(N, K // g)).astype(np.float32)
    scheme = QuantScheme("compressed-tensors", "int8", group_size=g, packing="compressed-tensors")
    leaves = convert(scheme, {"weight": w, "weight_scale": s})
    want = (w.astype(np.float32) * np.repeat(s, g, axis=1)).T
    np.testing.assert_allclose(restored(leaves, scheme), want, rtol=1e-7)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_per_tensor(static):
    rng = np.random.default_rng(7)
    w = packers.fp8_codes(rng, N, K)
    scheme = QuantScheme("fp8", "fp8", "fp8", static_input_scale=static, packing="fp8")
    tensors = {"weight": w, "weight_scale": np.float32(0.003), "input_scale": np.float32(0.02)}
    leaves = convert(scheme, tensors)
    assert leaves["weight_scale"].shape == (N,)
    np.testing.assert_array_equal(np.asarray(leaves["qweight"]).view(np.uint8), w.view(np.uint8))  # [N, K]
    assert ("input_scale" in leaves) == static
    if static:
        assert float(leaves["input_scale"]) == np.float32(0.02)
    np.testing.assert_allclose(
        restored(leaves, scheme), w.astype(np.float32).T * np.float32(0.003), rtol=1e-7
    )


def test_eight_bit_wrong_dtype_names_the_module():
    scheme = QuantScheme("compressed-tensors", "fp8", "fp8", packing="compressed-tensors")
    w = np.zeros((N, K), np.int8)
    with pytest.raises(ValueError, match=r"up_proj: weight is int8.*float8_e4m3fn"):
        convert(scheme, {"weight": w, "weight_scale": np.ones((N, 1), np.float32)})


def test_eight_bit_bad_scale_shape_names_the_module():
    scheme = QuantScheme("compressed-tensors", "int8", "int8", packing="compressed-tensors")
    w = np.zeros((N, K), np.int8)
    with pytest.raises(ValueError, match=r"up_proj: weight_scale of shape \(3,\)"):
        convert(scheme, {"weight": w, "weight_scale": np.ones((3,), np.float32)})


# --- one int32 of each packing, decoded by hand --------------------------------------------------------


def test_awq_one_word_by_hand():
    # K = 2 rows, N = 8 columns, one group of 2 rows: each row is one int32 of 8 nibbles
    qweight = np.array([[0x76543210], [0xFEDCBA98]], np.uint32).view(np.int32)
    # nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]: row 0's nibbles 0..7 are the values 0..7
    codes = np.array([[0, 4, 1, 5, 2, 6, 3, 7], [8, 12, 9, 13, 10, 14, 11, 15]], np.float32)
    qzeros = np.array([[0x00000031]], np.uint32).view(np.int32)  # nibble 0 = 1 (column 0), 1 = 3 (column 2)
    zeros = np.array([[1, 0, 3, 0, 0, 0, 0, 0]], np.float32)
    scales = np.full((1, 8), 0.5, np.float16)
    scheme = QuantScheme("awq", "int4", group_size=2, packing="awq")
    leaves = convert(scheme, {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    np.testing.assert_array_equal(restored(leaves, scheme), (codes - zeros) * 0.5)


@pytest.mark.parametrize(("fmt", "zero_word"), [("gptq", 0x77777777), ("gptq_v2", 0x88888888)])
def test_gptq_one_word_by_hand(fmt, zero_word):
    # K = 8 inputs in one int32 per column, N = 8; column 0's word holds inputs 0..7 as 0..7
    qweight = np.full((1, 8), 0x88888888, np.uint32)
    qweight[0, 0] = 0x76543210
    qzeros = np.array([[zero_word]], np.uint32).view(np.int32)  # zero 8 in every column (v1: stores 7)
    scales = np.full((1, 8), 2.0, np.float16)
    scheme = QuantScheme("gptq", "int4", group_size=8, packing=fmt)
    tensors = {"qweight": qweight.view(np.int32), "qzeros": qzeros, "scales": scales}
    want = np.zeros((8, 8), np.float32)
    want[:, 0] = (np.arange(8) - 8) * 2.0
    np.testing.assert_array_equal(restored(convert(scheme, tensors), scheme), want)


def test_compressed_tensors_one_word_by_hand():
    # N = 1 output, K = 8 inputs in one int32: stored value u is the signed code u - 8
    packed = np.array([[0x76543210]], np.uint32).view(np.int32)
    tensors = {
        "weight_packed": packed,
        "weight_scale": np.array([[0.25]], np.float16),
        "weight_shape": np.array([1, 8], np.int64),
    }
    scheme = QuantScheme("compressed-tensors", "int4", packing="pack-quantized")
    want = ((np.arange(8) - 8) * 0.25).astype(np.float32).reshape(8, 1)
    np.testing.assert_array_equal(restored(convert(scheme, tensors), scheme), want)


def test_compressed_tensors_zero_point_word_by_hand():
    # N = 8 outputs, K = 8 inputs, per channel, asymmetric: the zero points of outputs 0..7 share one int32
    packed = np.full((8, 1), 0x88888888, np.uint32).view(np.int32)  # every code 0 (stored 8)
    zp = np.array([[0x76543210]], np.uint32).view(np.int32)  # output n: stored n, zero point n - 8
    tensors = {
        "weight_packed": packed,
        "weight_scale": np.ones((8, 1), np.float16),
        "weight_zero_point": zp,
        "weight_shape": np.array([8, 8], np.int64),
    }
    scheme = QuantScheme("compressed-tensors", "int4", packing="pack-quantized", symmetric=False)
    want = np.broadcast_to(8.0 - np.arange(8, dtype=np.float32), (8, 8))  # (0 - (n - 8)) * 1
    np.testing.assert_array_equal(restored(convert(scheme, tensors), scheme), want)


def test_fp8_bytes_by_hand():
    # e4m3: 0x38 = 1.0, 0x40 = 2.0, 0xC0 = -2.0, 0x3C = 1.5
    w = np.array([[0x38, 0x40], [0xC0, 0x3C]], np.uint8).view(ml_dtypes.float8_e4m3fn)  # [N, K]
    scheme = QuantScheme("fp8", "fp8", "fp8", packing="fp8")
    leaves = convert(scheme, {"weight": w, "weight_scale": np.float32(0.5)})
    np.testing.assert_array_equal(restored(leaves, scheme), np.array([[0.5, -1.0], [1.0, 0.75]], np.float32))
