"""Architecture name (HF `architectures[0]`) -> Flax module class, and the abstract parameter tree.

`build_model(arch, attn_backend, tp_size)` returns the module; `abstract_params(module, dtype)` returns the
pytree of `jax.ShapeDtypeStruct` every loader fills (and checks shapes against) without allocating.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.layers.attention_metadata import AttentionMetadata
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.gemma3 import Gemma3ForCausalLM
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.moe_llama import MoeForCausalLM
from jaxllm.models.opt import OPTForCausalLM
from jaxllm.quantization.scheme import FLOAT32_LEAVES

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # q|k|v and gate|up held whole in the checkpoint (loader/names.py)
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return MODEL_REGISTRY[architecture]


def build_model(arch: ModelArchConfig, attn_backend: str = "reference", tp_size: int = 1) -> nn.Module:
    """`tp_size`: the tensor-parallel shards a model with fused projections lays them out for
    (models/fused_projections.py); models without them ignore it."""
    cls = get_model_class(arch.architecture)
    if "tp_size" in cls.__dataclass_fields__:
        return cls(arch=arch, attn_backend=attn_backend, tp_size=tp_size)
    return cls(arch=arch, attn_backend=attn_backend)


def fused_groups(module: nn.Module) -> tuple:
    """The module's fused projections (FusedGroup), which the loader builds from the checkpoint's parts."""
    return module.fused_groups() if hasattr(module, "fused_groups") else ()


def kv_cache_heads(arch: ModelArchConfig, tp_size: int) -> int:
    """Head slots of the KV cache's axis 0 over `tp_size` devices: Hkv, or `tp_size` when there are fewer
    KV heads than devices (each device then keeps the one KV head its query heads read, so a head is stored
    tp_size / Hkv times; the fused q|k|v weight holds the same slots: models/fused_projections.py).
    A fact of the model's geometry, which the sharding rules of jaxllm.parallel read."""
    return max(arch.num_kv_heads, tp_size)


def kv_slots(module: nn.Module) -> int:
    """KV heads the module's layers produce: Nkv, or the tensor-parallel size when that is larger."""
    return kv_cache_heads(module.arch, getattr(module, "tp_size", 1))


def dummy_inputs(
    arch: ModelArchConfig, num_tokens: int = 1, num_blocks: int = 1, block_size: int = 1, kv_heads=None
):
    """(input_ids, kv_caches, md) of the smallest shapes, for init/eval_shape."""
    kv_heads = arch.num_kv_heads if kv_heads is None else kv_heads
    kv = jnp.zeros((kv_heads, num_blocks, block_size, arch.head_dim), jnp.float32)
    md = AttentionMetadata(
        positions=jnp.zeros((num_tokens,), jnp.int32),
        slot_mapping=jnp.zeros((num_tokens,), jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        cu_q_lens=jnp.array([0, num_tokens], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
    )
    return jnp.zeros((num_tokens,), jnp.int32), [(kv, kv)] * arch.num_layers, md


def abstract_params(module: nn.Module, dtype: jnp.dtype) -> dict:
    """Pytree of ShapeDtypeStruct (float leaves in `dtype`) with the module's parameter paths.

    The decoder layers `layers_{i}` all have one layer's parameters, so only a one-layer model is traced
    (`init` traces every layer's Python, a second of a large model's load) and its `layers_0` is shared."""
    arch = module.arch
    # layers that differ (GGUF's per-tensor types: arch.layer_quant; a MoE model's dense MLP layers:
    # arch.dense_mlp_layers) are traced once per kind
    quants = arch.layer_quant or (None,) * arch.num_layers
    kinds = [(q, i in arch.dense_mlp_layers) for i, q in enumerate(quants)]
    traced: dict = {}
    shapes: dict = {}
    for i, kind in enumerate(kinds):
        if kind not in traced:
            quant, dense = kind
            one_arch = dataclasses.replace(
                arch,
                num_layers=1,
                layer_quant=None if quant is None else (quant,),
                dense_mlp_layers=(0,) if dense else (),
            )
            one = module.clone(arch=one_arch)
            ids, caches, md = dummy_inputs(one_arch, kv_heads=kv_slots(module))
            init = functools.partial(one.init, jax.random.key(0), ids, caches, md, method="init_all")
            tree = jax.eval_shape(init)
            traced[kind] = dict(tree["params"])
        shapes[f"layers_{i}"] = traced[kind]["layers_0"]
    shapes.update({k: v for k, v in traced[kinds[0]].items() if k != "layers_0"})
    return jax.tree_util.tree_map_with_path(lambda path, s: _leaf_struct(path, s, dtype), shapes)


def _leaf_struct(path, s: jax.ShapeDtypeStruct, dtype) -> jax.ShapeDtypeStruct:
    """Float leaves take the model's dtype; a quantized layer's integer/fp8 weights keep theirs, and its
    W8A8 scales stay float32 (they multiply an f32 accumulator)."""
    name = path[-1].key
    if s.dtype != jnp.float32 or name in FLOAT32_LEAVES:
        return jax.ShapeDtypeStruct(s.shape, s.dtype)
    return jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype))
