"""Where each parameter and the KV cache live on the "tp" mesh axis (Megatron-style layout).

Rules go by parameter path (see the tree in jaxllm/models/llama.py and opt.py):
  qkv_proj, gate_up_proj (fused, laid out shard by   column-parallel: out split          P(None, tp)
    shard: models/fused_projections.py), q_proj,
    k_proj, v_proj (OPT's separate ones: N must divide
    their heads), fc1 (kernel [in, out], bias [out])
  o_proj, down_proj, fc2 (kernel [in, out])          row-parallel: in split              P(tp, None)
  quantized layers (jaxllm/quantization/scheme.py):  qweight, scales, zeros, weight_scale as the kernel
    along N; a row-parallel layer's group scales/zeros [K/g, N] split with K (whole groups per device),
    per-channel ones [1, N] / [N] replicated; perm and input_scale replicated (XLA gathers x for perm).
    A W8A8 qweight is held [N, K] (K contiguous for the FP8 GEMM), so its axes swap: column-parallel
    P(tp, None), row-parallel P(None, tp); the layer's scheme (arch) says which qweights are W8A8
  experts/gate_up_proj/kernel [E, H, 2I] (MoE: each   every expert split along I    P(None, None, tp)
    expert's gate|up, fused shard by shard)
  experts/down_proj/kernel [E, I, H]                                              P(None, tp, None)
    (the router mlp/gate/kernel [H, E] is replicated; layers/moe.py says why experts split this way)
  embed_tokens/embedding [V, E], lm_head/kernel      vocab-parallel (replicated, with a warning, when N
    [E, V]                                           does not divide V)
  everything else (norms, row-parallel biases, OPT   replicated                          P()
    positions)
XLA's SPMD partitioner turns this into an all-reduce after o_proj and down_proj and a gather of the
vocab-parallel logits; there is no hand-written communication.

KV heads (vLLM's rule): N % Hkv == 0 or Hkv % N == 0. With N <= Hkv every device owns Hkv / N KV heads.
With N > Hkv the cache gets N head slots, one per device; device r keeps KV head r // (N / Hkv), the one
its query heads read (each KV head is stored N / Hkv times). The fused q|k|v weight holds those slots
already (each device computes only its own K/V head); separate K/V projections (OPT, multi-head) need N
to divide their heads.
"""

from __future__ import annotations

import logging
import re

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.models.config import ModelArchConfig
from jaxllm.models.llama import layer_quant
from jaxllm.parallel.mesh import TP_AXIS

logger = logging.getLogger("jaxllm")

# a projection's leaves whose last axis is its output N (a quantized layer's too: scheme.py; a W8A8 qweight
# [N, K] matches them too, and param_partition_spec swaps its spec)
_N_LEAVES = "kernel|bias|qweight|scales|zeros|weight_scale"
_EXPERTS_COLUMN = re.compile(r"(^|/)experts/gate_up_proj/kernel$")  # [E, H, 2I]
_EXPERTS_ROW = re.compile(r"(^|/)experts/down_proj/kernel$")  # [E, I, H]
_COLUMN = re.compile(rf"(^|/)(qkv_proj|gate_up_proj|q_proj|gate_proj|up_proj|fc1)/({_N_LEAVES})$")
_KV = re.compile(rf"(^|/)(k_proj|v_proj)/({_N_LEAVES})$")  # separate K/V: column-parallel, N divides Hkv
_ROW = re.compile(r"(^|/)(o_proj|down_proj|fc2)/(kernel|qweight)$")
_ROW_GROUPS = re.compile(r"(^|/)(o_proj|down_proj|fc2)/(scales|zeros)$")  # [K/g, N]: groups split with K
_VOCAB_ROWS = re.compile(r"(^|/)embed_tokens/embedding$")
_VOCAB_COLS = re.compile(r"(^|/)lm_head/kernel$")
_LAYER_QWEIGHT = re.compile(r"(?:^|/)layers_(\d+)/(?:.+/)?([^/]+)/qweight$")  # (layer index, projection)


def validate_tensor_parallel(arch: ModelArchConfig, n: int) -> None:
    """Raise ValueError naming the numbers when the model cannot be split over `n` devices."""
    if n == 1:
        return
    if arch.num_heads % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the number of attention heads ({arch.num_heads})"
        )
    hkv = arch.num_kv_heads
    if hkv % n and n % hkv:
        raise ValueError(
            f"tensor_parallel_size={n} and the number of KV heads ({hkv}) must divide one another "
            f"(N % num_kv_heads == 0 or num_kv_heads % N == 0)"
        )
    if arch.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the MLP intermediate size ({arch.intermediate_size})"
        )
    if arch.num_experts and arch.moe_intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the experts' intermediate size "
            f"(moe_intermediate_size={arch.moe_intermediate_size})"
        )


def _is_w8a8_qweight(path: str, arch: ModelArchConfig) -> bool:
    """Whether `path` is the qweight [N, K] of a W8A8 layer, by the scheme the model gives that layer."""
    m = _LAYER_QWEIGHT.search(path)
    if m is None:
        return False
    scheme = layer_quant(arch, int(m.group(1))).get(m.group(2))
    return scheme is not None and not scheme.weight_only


def param_partition_spec(path: str, ndim: int, shape: tuple[int, ...], arch: ModelArchConfig, n: int) -> P:
    if _is_w8a8_qweight(path, arch):  # [N, K]: the rule of a [K, N] qweight, its axes swapped
        return P(*reversed(tuple(_partition_spec(path, ndim, tuple(shape[::-1]), arch, n))))
    return _partition_spec(path, ndim, shape, arch, n)


def _partition_spec(path: str, ndim: int, shape: tuple[int, ...], arch: ModelArchConfig, n: int) -> P:
    """The rules of the module docstring for leaves whose last axis is N (every one but a W8A8 qweight)."""
    if n == 1:
        return P()
    if _EXPERTS_COLUMN.search(path):
        return P(None, None, TP_AXIS)
    if _EXPERTS_ROW.search(path):
        return P(None, TP_AXIS, None)
    if _COLUMN.search(path):
        return P(None, TP_AXIS) if ndim == 2 else P(TP_AXIS)
    if _KV.search(path):
        if arch.num_kv_heads % n:
            raise ValueError(
                f"{path}: {arch.num_kv_heads} KV heads do not split over tensor_parallel_size={n} "
                "(separate K/V projections need N to divide them; fused q|k|v gets one K/V slot per device)"
            )
        return P(None, TP_AXIS) if ndim == 2 else P(TP_AXIS)
    if _ROW.search(path):
        return P(TP_AXIS, None)
    if _ROW_GROUPS.search(path):
        if shape[0] == 1:  # one scale per output channel: every shard needs all of them
            return P()
        if shape[0] % n:
            raise ValueError(
                f"{path}: {shape[0]} quantization groups along the input do not split over "
                f"tensor_parallel_size={n}; each shard needs whole groups"
            )
        return P(TP_AXIS, None)
    vocab_rows, vocab_cols = _VOCAB_ROWS.search(path), _VOCAB_COLS.search(path)
    if vocab_rows or vocab_cols:
        vocab = shape[0] if vocab_rows else shape[1]
        if vocab % n:
            logger.warning(
                "vocab size %d is not divisible by tensor_parallel_size=%d: %s is replicated", vocab, n, path
            )
            return P()
        return P(TP_AXIS, None) if vocab_rows else P(None, TP_AXIS)
    return P()


def param_sharding_fn(mesh: Mesh, arch: ModelArchConfig):
    """`(path, ShapeDtypeStruct) -> NamedSharding` for the loader (which places each param as it loads)."""
    n = mesh.shape[TP_AXIS]

    def sharding_fn(path: str, sds: jax.ShapeDtypeStruct) -> NamedSharding:
        return NamedSharding(mesh, param_partition_spec(path, len(sds.shape), tuple(sds.shape), arch, n))

    return sharding_fn


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Each layer's [Hkv, P, PS, D] pages split on the head axis."""
    return NamedSharding(mesh, P(TP_AXIS, None, None, None))
