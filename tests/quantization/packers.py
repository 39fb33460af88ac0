"""Independent numpy writers of the quantized checkpoint packings, straight from each format's definition.

The tests pack random codes/scales/zeros with these, convert with jaxllm's loader code and compare the
dequantized weight with the float weight computed here, so a wrong nibble order, zero offset or axis
in either side fails. Nothing here imports jaxllm. Shapes: K inputs, N outputs, g group size; the
torch layout of a linear weight is [N, K], the float weights returned here are [K, N] (jaxllm's kernel).

  AWQ (AutoAWQ GEMM)  qweight i32[K, N/8], qzeros i32[K/g, N/8]: nibble i (bits 4i..4i+3) of int32 c
                      holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales f16[K/g, N]
  GPTQ                qweight i32[K/8, N]: nibble i of row r holds input 8r + i; qzeros i32[K/g, N/8]:
                      nibble i of column c holds output 8c + i, v1 storing zero - 1; g_idx i32[K]: the
                      group of each input row (act order: rows in the order GPTQ visited them)
  compressed-tensors  pack-quantized: weight_packed i32[N, K*b/32], value i of int32 c is input
                      (32/b)c + i, stored as the signed code + 2^(b-1); weight_zero_point packed the same
                      way along N: i32[N*b/32, K/g]; weight_scale [N, K/g]; weight_shape [2]
                      int-/float-quantized: weight i8|f8[N, K], weight_scale [N, 1] or [1]
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

AWQ_COLUMN_OF_NIBBLE = [0, 2, 4, 6, 1, 3, 5, 7]
FP8 = ml_dtypes.float8_e4m3fn


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15, nibble i at bits 4i -> i32[...]."""
    acc = np.zeros(nibbles.shape[:-1], np.uint64)
    for i in range(8):
        acc |= nibbles[..., i].astype(np.uint64) << np.uint64(4 * i)
    return acc.astype(np.uint32).view(np.int32)


def awq_pack_columns(x: np.ndarray) -> np.ndarray:
    """u8[R, N] -> i32[R, N/8] in AutoAWQ's interleaved column order."""
    r, n = x.shape
    words = np.zeros((r, n // 8, 8), np.uint8)
    for c in range(n // 8):
        for i in range(8):
            words[:, c, i] = x[:, 8 * c + AWQ_COLUMN_OF_NIBBLE[i]]
    return _words(words)


def pack_rows(x: np.ndarray) -> np.ndarray:
    """u8[R, N] -> i32[R/8, N]: nibble i of row r holds row 8r + i (GPTQ's qweight)."""
    r, n = x.shape
    return _words(np.stack([x[i::8] for i in range(8)], axis=-1))


def pack_columns(x: np.ndarray) -> np.ndarray:
    """u8[R, N] -> i32[R, N/8]: nibble i of column c holds column 8c + i (GPTQ's qzeros)."""
    return _words(np.stack([x[:, i::8] for i in range(8)], axis=-1))


def random_int4(rng, k: int, n: int, g: int, zero_low: int = 0):
    """(codes u8[K, N], zeros u8[K/g, N], scales f32[K/g, N]) with exactly representable f16 scales."""
    q = rng.integers(0, 16, size=(k, n)).astype(np.uint8)
    z = rng.integers(zero_low, 16, size=(k // g, n)).astype(np.uint8)
    s = (rng.uniform(0.005, 0.05, size=(k // g, n))).astype(np.float16).astype(np.float32)
    return q, z, s


def int4_weight(q, z, s, g_idx) -> np.ndarray:
    """f32[K, N]: w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]."""
    return ((q.astype(np.float32) - z[g_idx].astype(np.float32)) * s[g_idx]).astype(np.float32)


def awq_checkpoint(q, z, s) -> dict[str, np.ndarray]:
    return {"qweight": awq_pack_columns(q), "qzeros": awq_pack_columns(z), "scales": s.astype(np.float16)}


def gptq_checkpoint(q, z, s, g_idx, version: int = 1) -> dict[str, np.ndarray]:
    if version == 1:
        assert z.min() >= 1, "GPTQ v1 stores zero - 1 in 4 bits: zero points 1..15"
        z = z - 1
    return {
        "qweight": pack_rows(q),
        "qzeros": pack_columns(z.astype(np.uint8)),
        "scales": s.astype(np.float16),
        "g_idx": np.asarray(g_idx, np.int32),
    }


def act_order_g_idx(rng, k: int, g: int) -> np.ndarray:
    """GPTQ desc_act: rows are visited in a random order and grouped in that order."""
    visit = rng.permutation(k)
    g_idx = np.empty(k, np.int32)
    g_idx[visit] = np.arange(k) // g
    return g_idx


def ct_pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """signed codes [R, C] -> i32, (32/bits) per int32 along `axis`, each stored as code + 2^(bits-1)."""
    per = 32 // bits
    u = (values.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    assert u.min() >= 0 and u.max() < (1 << bits)
    if axis == 0:
        return ct_pack(values.T, bits, 1).T.copy()
    r, c = u.shape
    pad = -c % per
    u = np.pad(u, ((0, 0), (0, pad)))
    acc = np.zeros((r, u.shape[1] // per), np.uint64)
    for i in range(per):
        acc |= u[:, i::per] << np.uint64(bits * i)
    return acc.astype(np.uint32).view(np.int32)


def ct_pack_quantized(q_signed, s, zp_signed=None, g_idx=None, bits: int = 4) -> dict[str, np.ndarray]:
    """q_signed [N, K], s [N, K/g], zp_signed [N, K/g] or None (symmetric)."""
    n, k = q_signed.shape
    out = {
        "weight_packed": ct_pack(q_signed, bits, axis=1),
        "weight_scale": s.astype(np.float16),
        "weight_shape": np.asarray([n, k], np.int64),
    }
    if zp_signed is not None:
        out["weight_zero_point"] = ct_pack(zp_signed, bits, axis=0)
    if g_idx is not None:
        out["weight_g_idx"] = np.asarray(g_idx, np.int32)
    return out


def fp8_codes(rng, n: int, k: int) -> np.ndarray:
    """f8[N, K]: random finite e4m3 values across the whole range (never NaN)."""
    x = rng.standard_normal((n, k)) * 64
    return np.clip(x, -448, 448).astype(FP8)
