"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`) as a functional Flax linen module.

Data flow of `__call__(input_ids, kv_caches, md)`:
  input_ids i32[T] -> embed_tokens * sqrt(H) (the scale cast to the embedding dtype first, as HF does) ->
  for each layer (its kind from arch.layer_types; one shared trace per kind, models/layer_trace.py):
    x + post_attn_norm(attn(input_norm(x)))   q/k/v proj -> q/k GemmaRMSNorm per head -> rotary
                                              (global layers: rope_theta with the config's scaling; sliding
                                              layers: rope_local_theta, unscaled) -> paged attention with
                                              scale query_pre_attn_scalar**-0.5, the sliding window on
                                              sliding layers only (no score soft-cap: config.py)
    x + post_ffw_norm(mlp(pre_ffw_norm(x)))   down(gelu_tanh(gate(x)) * up(x)) (models/llama.py's LlamaMLP)
  -> norm -> hidden [T, H].
`compute_logits(hidden [N, H])` -> f32[N, V] (tied embedding, or lm_head), final_logit_softcapping if set.

Parameter tree: models/llama.py's, with every norm a GemmaRMSNorm (`scale` holds the checkpoint's
zero-centred weight; the norm multiplies by 1 + scale) and two more norms per layer:
  layers_{i}/pre_ffw_norm/scale    [H]   (pre_feedforward_layernorm; GGUF ffn_norm)
  layers_{i}/post_ffw_norm/scale   [H]   (post_feedforward_layernorm; GGUF post_ffw_norm)
  layers_{i}/post_attn_norm/scale  [H]   here the norm of the attention output (GGUF post_attention_norm)
q|k|v and gate|up are fused at load as for Llama (models/fused_projections.py). Research hooks
(captures, steering) are Llama-only: `research` is refused.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.layers.attention import kv_cache_scales, paged_attention
from jaxllm.layers.attention_metadata import AttentionMetadata, KVCache
from jaxllm.layers.linear import linear
from jaxllm.layers.norm import GemmaRMSNorm
from jaxllm.layers.rotary import apply_rotary, rope_inv_freq
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fused_projections import split_columns
from jaxllm.models.layer_trace import call_layer
from jaxllm.models.llama import LlamaForCausalLM, LlamaMLP, layer_quant, qkv_group
from jaxllm.quantization.scheme import LayerQuant


def is_sliding(a: ModelArchConfig, i: int) -> bool:
    """Whether layer i attends within the sliding window (else to the whole context)."""
    if a.layer_types is None:
        return a.sliding_window is not None
    return a.layer_types[i] == "sliding_attention"


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


class Gemma3Attention(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    tp_size: int = 1
    quant: LayerQuant = LayerQuant()
    sliding: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        kv_cache: KVCache,  # ([S, P, PS, D], [S, P, PS, D])
        md: AttentionMetadata,
        inv_freq: jax.Array,  # f32[D/2]
        attention_factor: float,
    ) -> tuple[jax.Array, KVCache]:
        a = self.arch
        t = x.shape[0]
        kernels = self.attn_backend != "reference"
        group = qkv_group(a, self.tp_size)
        qkv = linear(group.width, a.attention_bias, self.quant.get("qkv_proj"), "qkv_proj", kernels)(x)
        q, k, v = split_columns(group, qkv)
        q = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, name="q_norm")(q.reshape(t, a.num_heads, a.head_dim))
        k = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, name="k_norm")(k.reshape(t, -1, a.head_dim))  # [T, S, D]
        v = v.reshape(t, -1, a.head_dim)
        q = apply_rotary(q, md.positions, inv_freq, attention_factor)
        k = apply_rotary(k, md.positions, inv_freq, attention_factor)
        scalar = a.query_pre_attn_scalar or a.head_dim
        k_scale, v_scale = kv_cache_scales(self)  # fp8 caches only
        out, kv_cache = paged_attention(
            q, k, v, kv_cache, md,
            sm_scale=scalar**-0.5, backend=self.attn_backend,
            sliding_window=a.sliding_window if self.sliding else None, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        out = linear(a.hidden_size, a.o_proj_bias, self.quant.get("o_proj"), "o_proj", kernels)(
            out.reshape(t, -1)
        )
        return out, kv_cache


class Gemma3DecoderLayer(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    tp_size: int = 1
    quant: LayerQuant = LayerQuant()
    sliding: bool = False

    @nn.compact
    def __call__(self, x, kv_cache, md, inv_freq, attention_factor=1.0):  # x: [T, H]
        a = self.arch
        norm = lambda name: GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, name=name)  # noqa: E731
        attn = Gemma3Attention(a, self.attn_backend, self.tp_size, self.quant, self.sliding, name="attn")
        h, kv_cache = attn(norm("input_norm")(x), kv_cache, md, inv_freq, attention_factor)
        x = x + norm("post_attn_norm")(h)
        mlp = LlamaMLP(a, self.tp_size, self.attn_backend != "reference", self.quant, name="mlp")
        x = x + norm("post_ffw_norm")(mlp(norm("pre_ffw_norm")(x)))
        return x, kv_cache


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's model with Gemma's layers, scaled embeddings, two rotary bases and a logit soft-cap; the
    fused projections and the head as Llama's (layers of a kind share one trace: models/layer_trace.py)."""

    supports_research = False  # research hooks are written for the Llama family (models/research_hooks.py)

    def decoder_layer(self, i: int) -> nn.Module:
        a = self.arch
        return Gemma3DecoderLayer(a, self.attn_backend, self.tp_size, layer_quant(a, i), is_sliding(a, i))

    def final_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.arch.hidden_size, self.arch.rms_norm_eps)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        kv_caches: list[KVCache],  # per layer ([S, P, PS, D], [S, P, PS, D])
        md: AttentionMetadata,
        research=None,
    ):  # ([T, H], updated caches)
        if research is not None:
            raise ValueError(
                f"{self.arch.architecture} does not support research inputs (captures, steering)"
            )
        a = self.arch
        global_freq, global_factor = rope_inv_freq(
            a.head_dim, a.rope_theta, a.rope, a.max_position_embeddings
        )
        theta = a.rope_local_theta or a.rope_theta
        local_freq, _ = rope_inv_freq(a.head_dim, theta, {"rope_type": "default"}, a.max_position_embeddings)
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * jnp.asarray(math.sqrt(a.hidden_size), x.dtype)
        new_caches = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            sliding = is_sliding(a, i)
            inv_freq = jnp.asarray(local_freq if sliding else global_freq)
            x, kv_cache = call_layer(
                self, layer, x, kv_cache, md, inv_freq, attention_factor=1.0 if sliding else global_factor
            )
            new_caches.append(kv_cache)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, H] -> f32[N, V]
        return soft_cap(super().compute_logits(hidden), self.arch.final_logit_softcapping)
