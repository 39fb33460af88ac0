"""OPT decoder (facebook/opt-*) as a functional Flax linen module.

Data flow of `__call__(input_ids, kv_caches, md)`:
  input_ids i32[T] -> embed_tokens [-> project_in] + embed_positions[md.positions + 2] -> for each layer:
    pre-LN (do_layer_norm_before):  x + attn(ln1(x));  x + fc2(relu(fc1(ln2(x))))
    post-LN (opt-350m):             ln1(x + attn(x));  ln2(x + fc2(relu(fc1(x))))
  -> [final_layer_norm] -> [project_out] -> hidden [T, word_embed_proj_dim] (= hidden_size for most OPTs).
`compute_logits(hidden_rows)` -> f32[N, V] (lm_head, tied to embed_tokens unless the config says not).

Parameter tree (kernels [in, out]; H hidden, E word_embed_proj_dim, F ffn_dim, V vocab, M max positions):
  embed_tokens/embedding [V, E]   embed_positions/embedding [M + 2, H]   project_in/kernel [E, H] (if E != H)
  layers_{i}/attn/{q,k,v}_proj/{kernel [H, H], bias [H]}   layers_{i}/attn/o_proj/{kernel, bias}
  layers_{i}/attn_norm/{scale, bias} [H]   layers_{i}/mlp/fc1/{kernel [H, F], bias}   mlp/fc2 [F, H]
  layers_{i}/attn/{k_scale, v_scale} f32[] (optional: FP8 KV-cache scales)
  layers_{i}/mlp_norm/{scale, bias}   final_norm/{scale, bias} (pre-LN only)   project_out/kernel [H, E]
  lm_head/kernel [E, V] (untied only)
"""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxllm.layers.attention import kv_cache_scales, paged_attention
from jaxllm.layers.attention_metadata import AttentionMetadata, KVCache
from jaxllm.layers.linear import linear
from jaxllm.layers.norm import LayerNorm
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.layer_trace import call_layer
from jaxllm.models.llama import ACTIVATIONS, tied_or_head_logits

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq padding convention)


class OPTAttention(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"

    @nn.compact
    def __call__(self, x, kv_cache: KVCache, md: AttentionMetadata):  # x: [T, H]
        a = self.arch
        t = x.shape[0]
        dense = lambda name: linear(a.hidden_size, a.enable_bias, a.quant, name)
        q = dense("q_proj")(x).reshape(t, a.num_heads, a.head_dim)
        k = dense("k_proj")(x).reshape(t, a.num_heads, a.head_dim)
        v = dense("v_proj")(x).reshape(t, a.num_heads, a.head_dim)
        k_scale, v_scale = kv_cache_scales(self)  # fp8 caches only
        out, kv_cache = paged_attention(
            q, k, v, kv_cache, md, sm_scale=a.head_dim**-0.5, backend=self.attn_backend,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return dense("o_proj")(out.reshape(t, -1)), kv_cache


class OPTMLP(nn.Module):
    arch: ModelArchConfig

    @nn.compact
    def __call__(self, x):  # [T, H] -> [T, H]
        a = self.arch
        h = ACTIVATIONS[a.hidden_act](linear(a.intermediate_size, a.enable_bias, a.quant, "fc1")(x))
        return linear(a.hidden_size, a.enable_bias, a.quant, "fc2")(h)


class OPTDecoderLayer(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"

    @nn.compact
    def __call__(self, x, kv_cache, md):
        a = self.arch
        attn_norm = LayerNorm(a.hidden_size, affine=a.layer_norm_elementwise_affine, name="attn_norm")
        mlp_norm = LayerNorm(a.hidden_size, affine=a.layer_norm_elementwise_affine, name="mlp_norm")
        attn = OPTAttention(a, self.attn_backend, name="attn")
        mlp = OPTMLP(a, name="mlp")
        if a.do_layer_norm_before:
            h, kv_cache = attn(attn_norm(x), kv_cache, md)
            x = x + h
            x = x + mlp(mlp_norm(x))
        else:
            h, kv_cache = attn(x, kv_cache, md)
            x = attn_norm(x + h)
            x = mlp_norm(x + mlp(x))
        return x, kv_cache


class OPTForCausalLM(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    trace_layers_once: bool = True  # layers share one trace per step shape (models/layer_trace.py)

    def setup(self) -> None:
        a = self.arch
        e = a.word_embed_proj_dim or a.hidden_size
        self.embed_tokens = nn.Embed(a.vocab_size, e)
        self.embed_positions = nn.Embed(a.max_position_embeddings + POSITION_OFFSET, a.hidden_size)
        if e != a.hidden_size:
            self.project_in = nn.Dense(a.hidden_size, use_bias=False)
            self.project_out = nn.Dense(e, use_bias=False)
        self.layers = [OPTDecoderLayer(a, self.attn_backend) for _ in range(a.num_layers)]
        if a.final_layer_norm:
            self.final_norm = LayerNorm(a.hidden_size, affine=a.layer_norm_elementwise_affine)
        if not a.tie_word_embeddings:
            self.lm_head = nn.Dense(a.vocab_size, use_bias=False)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        kv_caches: list[KVCache],  # per layer ([H/D, P, PS, D], [H/D, P, PS, D])
        md: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:  # ([T, E], updated caches)
        a = self.arch
        e = a.word_embed_proj_dim or a.hidden_size
        x = self.embed_tokens(input_ids)
        if e != a.hidden_size:
            x = self.project_in(x)
        x = x + self.embed_positions(md.positions + POSITION_OFFSET).astype(x.dtype)
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, kv_cache = call_layer(self, layer, x, kv_cache, md)
            new_caches.append(kv_cache)
        if a.final_layer_norm:
            x = self.final_norm(x)
        if e != a.hidden_size:
            x = self.project_out(x)
        return x, new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, E] -> f32[N, V]
        if self.is_initializing() and not self.arch.tie_word_embeddings:
            self.lm_head(hidden)
        if self.arch.tie_word_embeddings:
            return tied_or_head_logits(hidden, self.embed_tokens.embedding, None)
        return tied_or_head_logits(hidden, None, self.lm_head.variables["params"]["kernel"])

    def init_all(self, input_ids, kv_caches, md):
        """For `init`/`eval_shape`: touches every parameter (the forward pass and the head)."""
        hidden, _ = self(input_ids, kv_caches, md)
        return self.compute_logits(hidden)
