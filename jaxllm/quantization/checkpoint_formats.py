"""Quantized checkpoints' tensors of one linear module -> the canonical leaves of jaxllm/quantization/scheme.py.

Each packing names the tensors a quantized module has (suffixes of its name: `...q_proj.qweight`) and
turns them into the canonical leaves: [K, N] (K inputs, N outputs), except a W8A8 qweight, which keeps
the checkpoints' [N, K] (scheme.py says why). The layouts, as the tools write them:

  awq (AutoAWQ GEMM)    qweight i32[K, N/8], qzeros i32[K/g, N/8]: 8 nibbles per int32 along N, nibble i
                        holding column 8c + AWQ_ORDER[i]; scales f16[K/g, N]; w = (q - z) * s
  gptq / gptq_v2        qweight i32[K/8, N]: nibble i of row r is input row 8r + i; qzeros i32[K/g, N/8]
                        (nibble i of column c is output 8c + i; gptq (v1) stores z - 1); scales [K/g, N];
                        g_idx i32[K] (the group of each input row; with desc_act rows are not in group order:
                        they are sorted into groups here and `perm` reorders x to match)
  compressed-tensors    float-/int-/naive-quantized: weight [N, K] (fp8 | int8), weight_scale [N, 1]
                        (channel), [1] or [] (tensor) or [N, K/g] (group), input_scale [1] (static W8A8)
  pack-quantized        (compressed-tensors) weight_packed i32[N, K/8] for 4 bits (nibble i of column c
                        is input 8c + i, stored as the signed value + 8) or i32[N, K/4] for 8 bits (byte i
                        is input 4c + i, stored as the signed value + 128), weight_scale [N, K/g],
                        weight_zero_point i32[N/8, K/g] (4-bit asymmetric only; packed along N the same
                        way), weight_shape [2], weight_g_idx i32[K] (actorder "group")
  fp8 (vLLM/HF)         weight f8[N, K], weight_scale [] (per tensor), input_scale [] (static)
Tensors a scheme has no use for (a g_idx without act order, zero points of a symmetric scheme) are
skipped; a module missing one it needs is an error naming the tensor.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.int4_reference import pack_int4
from jaxllm.quantization.scheme import QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column AutoAWQ packs into nibble i of each int32


def unpack_nibbles(x, axis: int, order=tuple(range(8))):
    """i32 array -> u8 values 0..15, `axis` 8x longer: nibble i of element c lands at 8c + order[i]."""
    x = jnp.asarray(x)
    if x.dtype == jnp.int32:
        x = jax.lax.bitcast_convert_type(x, jnp.uint32)
    x = jnp.moveaxis(x.astype(jnp.uint32), axis, -1)  # [..., C]
    shifts = jnp.asarray([4 * order.index(j) for j in range(8)], jnp.uint32)  # position j's nibble
    vals = (x[..., None] >> shifts) & 0xF  # [..., C, 8]
    vals = vals.reshape(*x.shape[:-1], x.shape[-1] * 8).astype(jnp.uint8)
    return jnp.moveaxis(vals, -1, axis)


def unpack_bytes(x) -> jnp.ndarray:
    """i32[R, C] -> u8[R, 4C]: byte i (bits 8i..8i+7) of element c lands at 4c + i."""
    x = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.uint32)
    shifts = jnp.asarray([0, 8, 16, 24], jnp.uint32)
    vals = (x[..., None] >> shifts) & 0xFF  # [R, C, 4]
    return vals.reshape(x.shape[0], x.shape[1] * 4).astype(jnp.uint8)


def sort_act_order(q, g_idx, group: int, where: str):
    """(q rows in group order, perm i32[K]) for act-order g_idx; ValueError when a group is not `group` rows."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(g_idx.shape[0]) // group):
        raise ValueError(f"{where}: g_idx does not give every group {group} input rows")
    return jnp.asarray(q)[perm], jnp.asarray(perm, jnp.int32)


class Packing:
    name = ""
    needs: tuple[str, ...] = ()  # suffixes every module has

    def __init__(self, scheme: QuantScheme):
        self.scheme = scheme

    def suffixes(self) -> tuple[set[str], set[str]]:
        """(needed, skipped) tensor suffixes of one module under this scheme."""
        return set(self.needs), set()

    def convert(self, t: dict[str, Any], where: str) -> dict[str, Any]:
        raise NotImplementedError


class AWQPacking(Packing):
    name = "awq"
    needs = ("qweight", "qzeros", "scales")

    def convert(self, t, where):
        q = unpack_nibbles(t["qweight"], axis=-1, order=AWQ_ORDER)  # [K, N]
        z = unpack_nibbles(t["qzeros"], axis=-1, order=AWQ_ORDER)  # [K/g, N]
        return {"qweight": pack_int4(q), "scales": t["scales"], "zeros": z.astype(jnp.float32)}


class GPTQPacking(Packing):
    name = "gptq"
    needs = ("qweight", "qzeros", "scales")

    def suffixes(self):
        if self.scheme.act_order:
            return {*self.needs, "g_idx"}, set()
        return set(self.needs), {"g_idx"}

    def convert(self, t, where):
        q = unpack_nibbles(t["qweight"], axis=0)  # [K, N]
        z = unpack_nibbles(t["qzeros"], axis=-1).astype(jnp.float32)  # [K/g, N]
        if self.scheme.packing == "gptq":
            z = z + 1  # v1 checkpoints store each zero point minus one
        out = {"scales": t["scales"], "zeros": z}
        if self.scheme.act_order:
            q, out["perm"] = sort_act_order(q, t["g_idx"], self.scheme.group(q.shape[0]), where)
        out["qweight"] = pack_int4(q)
        return out


class CompressedTensorsPacking(Packing):
    """float-/int-/naive-quantized: the 8-bit weight as stored (scheme.packing "compressed-tensors")."""

    name = "compressed-tensors"

    def suffixes(self):
        s = self.scheme
        needed = {"weight", "weight_scale"}
        if s.static_input_scale:
            needed.add("input_scale")
        return needed, {"weight_zero_point"} | (set() if s.static_input_scale else {"input_scale"})

    def convert(self, t, where):
        return _eight_bit(self.scheme, t["weight"], t["weight_scale"], t.get("input_scale"), where)


class PackQuantizedPacking(Packing):
    """compressed-tensors' pack-quantized: int4 (eight per int32) or int8 (four per int32) codes."""

    name = "pack-quantized"

    def suffixes(self):
        s = self.scheme
        needed = {"weight_packed", "weight_scale", "weight_shape"}
        skipped = set()
        (needed if not s.symmetric else skipped).add("weight_zero_point")
        (needed if s.act_order else skipped).add("weight_g_idx")
        return needed, skipped

    def convert(self, t, where):
        s = self.scheme
        n, k = (int(v) for v in np.asarray(t["weight_shape"]).reshape(-1))
        scales = jnp.asarray(t["weight_scale"])
        # [N, K/g] (group), [N, 1] (channel) or one number (tensor) -> [K/g, N]
        scales = jnp.broadcast_to(scales.reshape(1, 1), (1, n)) if scales.size == 1 else scales.T
        if s.weights == "int8":  # symmetric only (config.py): stored code + 128
            q = unpack_bytes(t["weight_packed"])[:, :k].T  # u8[K, N]
            q = (q.astype(jnp.int16) - 128).astype(jnp.int8)
            return {"qweight": q, "scales": scales}
        q = unpack_nibbles(t["weight_packed"], axis=-1)[:, :k].T  # u8[K, N]
        if s.symmetric:
            zeros = jnp.full(scales.shape, 8.0, jnp.float32)
        else:
            zeros = unpack_nibbles(t["weight_zero_point"], axis=0)[:n].T.astype(jnp.float32)
        out = {"scales": scales, "zeros": zeros}
        if s.act_order:
            q, out["perm"] = sort_act_order(q, t["weight_g_idx"], s.group(k), where)
        out["qweight"] = pack_int4(q)
        return out


class FP8Packing(Packing):
    name = "fp8"

    def suffixes(self):
        if self.scheme.static_input_scale:
            return {"weight", "weight_scale", "input_scale"}, set()
        return {"weight", "weight_scale"}, {"input_scale"}

    def convert(self, t, where):
        return _eight_bit(self.scheme, t["weight"], t["weight_scale"], t.get("input_scale"), where)


def _eight_bit(s: QuantScheme, weight, scale, input_scale, where: str) -> dict[str, Any]:
    """fp8/int8 weight [N, K] with channel ([N, 1]/[N]), tensor ([1]/[]) or group ([N, K/g]) scales: W8A8
    keeps the weight [N, K], weight-only transposes it to [K, N] (the layouts of scheme.py)."""
    w = jnp.asarray(weight)
    n, k = w.shape
    want = jnp.int8 if s.weights == "int8" else jnp.float8_e4m3fn
    if w.dtype != want:
        raise ValueError(
            f"{where}: weight is {w.dtype}, the scheme ({s.describe()}) stores {jnp.dtype(want).name}"
        )
    scale = jnp.asarray(scale, jnp.float32)
    if scale.size in (1, n):
        per_channel = jnp.broadcast_to(scale.reshape(-1), (n,))
        if s.weight_only:
            out = {"qweight": w.T, "scales": per_channel[None, :]}
        else:
            out = {"qweight": w, "weight_scale": per_channel}
    elif s.weight_only and scale.ndim == 2 and scale.shape[0] == n and k % scale.shape[1] == 0:
        out = {"qweight": w.T, "scales": scale.T}
    else:
        raise ValueError(
            f"{where}: weight_scale of shape {tuple(scale.shape)} fits no scale layout of [{n}, {k}]"
        )
    if s.static_input_scale:
        out["input_scale"] = jnp.asarray(input_scale, jnp.float32).reshape(())
    return out


PACKINGS = {
    "awq": AWQPacking,
    "gptq": GPTQPacking,
    "gptq_v2": GPTQPacking,
    "compressed-tensors": CompressedTensorsPacking,
    "pack-quantized": PackQuantizedPacking,
    "fp8": FP8Packing,
}


def packing_for(scheme: QuantScheme) -> Packing | None:
    """The packing of a pre-quantized checkpoint, or None for float weights (quantized at load, or random)."""
    return PACKINGS[scheme.packing](scheme) if scheme.packing else None
