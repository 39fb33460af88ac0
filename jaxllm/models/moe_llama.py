"""Mixture-of-experts decoders of the Llama layout: Mixtral and Qwen3-MoE.

The Llama decoder (models/llama.py: attention, norms, rotary, the forward pass and the head) with the MLP
of each sparse layer replaced by a router and E SwiGLU experts (layers/moe.py). Qwen3-MoE may keep a
dense MLP in some layers (`mlp_only_layers`, or every layer that `decoder_sparse_step` skips:
arch.dense_mlp_layers); those are LlamaMLP of width intermediate_size.

Parameter tree of a sparse layer's MLP (the rest as in models/llama.py; E experts, I = moe_intermediate_size):
  layers_{i}/mlp/gate/kernel                [H, E]       router (replicated)
  layers_{i}/mlp/experts/gate_up_proj/kernel [E, H, 2I]  each expert's gate|up fused (split along 2I
                                                         under tensor parallelism: layers/moe.py)
  layers_{i}/mlp/experts/down_proj/kernel   [E, I, H]    (split along I)
Checkpoints hold one [out, in] tensor per expert; the loader stacks them (loader/params_builder.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.layers.moe import sparse_moe
from jaxllm.layers.norm import RMSNorm
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fused_projections import FusedGroup, FusedPart
from jaxllm.models.llama import (
    ACTIVATIONS,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    gate_up_group,
    layer_quant,
    qkv_group,
)
from jaxllm.quantization.scheme import LayerQuant

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def experts_gate_up_group(a: ModelArchConfig, shards: int = 1) -> FusedGroup:
    """The experts' gate|up, fused along the last axis of the stacked [E, H, 2I] weight."""
    parts = (
        FusedPart("mlp/experts/gate_proj", a.moe_intermediate_size, 1),
        FusedPart("mlp/experts/up_proj", a.moe_intermediate_size, 1),
    )
    return FusedGroup("mlp/experts/gate_up_proj", parts, shards)


class ExpertWeights(nn.Module):
    """One stacked weight of all experts, as param `kernel` (so its path ends like a projection's)."""

    shape: tuple[int, ...]

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", nn.initializers.normal(0.02), self.shape, jnp.float32)


class MoeExperts(nn.Module):
    """The experts' stacked weights: (gate_up [E, H, 2I], down [E, I, H])."""

    arch: ModelArchConfig
    tp_size: int = 1

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        a = self.arch
        e, h, i = a.num_experts, a.hidden_size, a.moe_intermediate_size
        width = experts_gate_up_group(a, self.tp_size).width
        return ExpertWeights((e, h, width), name="gate_up_proj")(), ExpertWeights(
            (e, i, h), name="down_proj"
        )()


class SparseMoeBlock(nn.Module):
    arch: ModelArchConfig
    tp_size: int = 1
    use_kernels: bool = False  # the Pallas grouped GEMM (layers/moe.py), as the GPU attention backends

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        a = self.arch
        router = nn.Dense(a.num_experts, use_bias=False, name="gate")
        if self.is_initializing():
            router(x)  # creates the router's kernel, which sparse_moe reads
        gate_up, down = MoeExperts(a, self.tp_size, name="experts")()
        return sparse_moe(
            x,
            router.variables["params"]["kernel"],
            gate_up,
            down,
            top_k=a.num_experts_per_tok,
            renormalize=a.norm_topk_prob,
            act=ACTIVATIONS[a.hidden_act],
            shards=self.tp_size,
            kernel=self.use_kernels,
        )


class MoeDecoderLayer(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    tp_size: int = 1
    quant: LayerQuant = LayerQuant()
    sparse: bool = True  # experts (SparseMoeBlock) or a dense LlamaMLP

    @nn.compact
    def __call__(self, x, kv_cache, md, inv_freq, edits=None, attention_factor=1.0):  # x: [T, H]
        a = self.arch
        if edits is not None:
            raise ValueError(f"{a.architecture} does not support research inputs (captures, steering)")
        h, kv_cache = LlamaAttention(a, self.attn_backend, self.tp_size, self.quant, name="attn")(
            RMSNorm(a.hidden_size, a.rms_norm_eps, name="input_norm")(x),
            kv_cache,
            md,
            inv_freq,
            attention_factor,
        )
        x = x + h
        y = RMSNorm(a.hidden_size, a.rms_norm_eps, name="post_attn_norm")(x)
        if self.sparse:
            m = SparseMoeBlock(a, self.tp_size, self.attn_backend != "reference", name="mlp")(y)
        else:
            m = LlamaMLP(a, self.tp_size, self.attn_backend != "reference", self.quant, name="mlp")(y)
        return x + m, kv_cache


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's forward pass and head over MoeDecoderLayer. Research hooks are Llama-only."""

    supports_research = False

    def setup(self) -> None:
        a = self.arch
        if a.quant is not None or a.layer_quant is not None:
            raise ValueError(
                f"{a.architecture}: quantized mixture-of-experts checkpoints are not supported "
                f"(quantization={a.quant.describe() if a.quant else 'gguf'}); use a float checkpoint"
            )
        super().setup()

    def decoder_layer(self, i: int) -> nn.Module:
        a = self.arch
        return MoeDecoderLayer(
            a, self.attn_backend, self.tp_size, layer_quant(a, i), i not in a.dense_mlp_layers
        )

    def fused_groups(self) -> tuple[FusedGroup, ...]:
        a, n = self.arch, self.tp_size
        return qkv_group(a, n), gate_up_group(a, n), experts_gate_up_group(a, n)
