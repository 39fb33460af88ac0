"""GGUF quantized blocks -> the canonical int8 / int4 leaves (jaxllm/quantization/scheme.py), on the host.

A GGUF weight is [out, in] = [N, K] rows, each row a run of blocks along K. The types served quantized
all scale groups of 32 inputs (GROUP), so a block (or a Q4_K sub-block) is one group of the canonical
layout. Each block is read straight from its bytes (little-endian, as llama.cpp's ggml-common.h lays it
out; `gguf.quants` reads the same layout and is what the tests compare against):

  Q8_0  34 B per 32:   d f16, q i8[32]                               w = d * q
  Q4_0  18 B per 32:   d f16, nibbles[16]                            w = d * q - 8 d
  Q4_1  20 B per 32:   d f16, m f16, nibbles[16]                     w = d * q + m
        nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits)
  Q4_K 144 B per 256:  d f16, dmin f16, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
        nibbles[128] in four 32-byte chunks: chunk c holds sub-block 2c (low bits), 2c + 1 (high bits)
                                                                     w = d sc_j * q - dmin m_j

Every 4-bit type is thus w = step * q + offset per group, which the canonical form (q - zeros) * scales
holds with scales = step and zeros = -offset / step. A group whose step is 0 (a constant group: all its
weights equal offset) has no such zeros; its codes become 0, scales -offset and zeros 1, which gives the
same weights exactly.

Output stays in GGUF's [N, ...] orientation (rows = outputs), so the caller can undo llama.cpp's Q/K row
permutation on every leaf alike and transpose to [K, ...] as it does for float weights:
  int8: qweight i8[N, K], scales f32[N, K/32]
  int4: qweight u8[N, K/2] (byte j = q[2j] | q[2j+1] << 4), scales f32[N, K/32], zeros f32[N, K/32]
"""

from __future__ import annotations

import numpy as np

GROUP = 32  # inputs per scale: a Q8_0/Q4_0/Q4_1 block, a Q4_K sub-block
INT8_TYPES = ("Q8_0",)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # (weights, bytes)


def _blocks(raw: np.ndarray, qtype: str) -> np.ndarray:  # u8[N, K * bytes / weights] -> u8[N, B, bytes]
    weights, nbytes = _BLOCK[qtype]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{qtype} data of shape {raw.shape} is not rows of {nbytes}-byte blocks")
    return raw.reshape(raw.shape[0], raw.shape[1] // nbytes, nbytes)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:  # the f16 at byte `at` of each block, as f32[N, B]
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _pairs(nibbles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u8[..., 2n] of two codes a byte -> the canonical bytes (code 2i | code 2i + 1 << 4) of their low
    nibbles and of their high nibbles, u8[..., n] each: no byte is widened to one code first."""
    even, odd = nibbles[..., 0::2], nibbles[..., 1::2]
    return (even & 0xF) | ((odd & 0xF) << 4), (even >> 4) | (odd & 0xF0)


def _q4k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u8[N, B, 12] -> (sc, m), each u8[N, B, 8]: sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scale) and
    4-7 (min); sub-blocks 4-7 keep their low 4 bits in bytes 8-11 (scale low, min high nibble) and their
    top 2 bits in the top 2 bits of bytes 0-3 (scale) and 4-7 (min)."""
    lo_sc, lo_m, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    hi_sc = (rest & 0xF) | ((lo_sc >> 6) << 4)
    hi_m = (rest >> 4) | ((lo_m >> 6) << 4)
    return (
        np.concatenate([lo_sc & 0x3F, hi_sc], axis=-1),
        np.concatenate([lo_m & 0x3F, hi_m], axis=-1),
    )


def decode_int8(raw: np.ndarray, qtype: str) -> dict[str, np.ndarray]:
    """Q8_0 bytes u8[N, K/32 * 34] -> {qweight i8[N, K], scales f32[N, K/32]}."""
    if qtype not in INT8_TYPES:
        raise ValueError(f"{qtype} is not an 8-bit GGUF type served as int8 ({', '.join(INT8_TYPES)})")
    blocks = _blocks(raw, qtype)
    n, b, _ = blocks.shape
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, b * GROUP)
    return {"qweight": q, "scales": _f16(blocks, 0)}


def _int4_packed_step_offset(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(canonical bytes u8[N, G, 16], step f32[N, G], offset f32[N, G]) with w = step * q + offset, G = K/32."""
    blocks = _blocks(raw, qtype)
    n, b, _ = blocks.shape
    if qtype in ("Q4_0", "Q4_1"):  # elements 0-15 are the low nibbles, 16-31 the high ones
        lo, hi = _pairs(blocks[..., -16:])
        packed = np.concatenate([lo, hi], axis=-1)
        d = _f16(blocks, 0)
        return packed, d, (-8.0 * d if qtype == "Q4_0" else _f16(blocks, 2))
    if qtype == "Q4_K":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # [N, B]
        sc, m = _q4k_scales_mins(blocks[..., 4:16])  # [N, B, 8]
        lo, hi = _pairs(blocks[..., 16:144].reshape(n, b, 4, 32))  # sub-blocks 2c and 2c + 1: [N, B, 4, 16]
        packed = np.stack([lo, hi], axis=3).reshape(n, b * 8, 16)
        step = d[..., None] * sc.astype(np.float32)
        offset = -dmin[..., None] * m.astype(np.float32)
        return packed, step.reshape(n, b * 8), offset.reshape(n, b * 8)
    raise ValueError(f"{qtype} is not a 4-bit GGUF type served as int4 ({', '.join(INT4_TYPES)})")


def decode_int4(raw: np.ndarray, qtype: str) -> dict[str, np.ndarray]:
    """Q4_0 / Q4_1 / Q4_K bytes of N rows -> {qweight u8[N, K/2], scales f32[N, K/32], zeros f32[N, K/32]}."""
    packed, step, offset = _int4_packed_step_offset(raw, qtype)
    constant = step == 0
    if constant.any():
        packed = np.where(constant[..., None], np.uint8(0), packed)  # u8[N, G, 16]
    scales = np.where(constant, -offset, step)
    with np.errstate(divide="ignore", invalid="ignore"):
        # f64 for the division: the zero point is then the f32 nearest to -offset / step
        zeros = np.where(constant, 1.0, -offset.astype(np.float64) / np.where(constant, 1.0, step))
    return {
        "qweight": packed.reshape(packed.shape[0], -1),
        "scales": scales.astype(np.float32),
        "zeros": zeros.astype(np.float32),
    }


def decode_quantized(raw: np.ndarray, qtype: str) -> dict[str, np.ndarray]:
    """The canonical leaves (in [N, ...] orientation) of a Q8_0 / Q4_0 / Q4_1 / Q4_K tensor's bytes."""
    return decode_int8(raw, qtype) if qtype in INT8_TYPES else decode_int4(raw, qtype)
