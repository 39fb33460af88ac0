"""Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2, Qwen3, Phi-3) as a functional Flax linen module.

Data flow of `__call__(input_ids, kv_caches, md)`:
  input_ids i32[T] -> embed_tokens -> for each layer (unrolled Python loop, one param subtree each; the
  layer's trace is shared, models/layer_trace.py):
    x + attn(input_norm(x))       q/k/v proj -> [q/k RMSNorm per head] -> rotary(md.positions) ->
                                  layers.attention.paged_attention (writes K/V into the layer's pages)
    x + mlp(post_attn_norm(x))    down(silu(gate(x)) * up(x))
  -> norm -> hidden [T, H]; also returns the list of updated (k_pages, v_pages).
`compute_logits(hidden_rows [N, H])` -> f32[N, V] (lm_head, or embed_tokens transposed when tied).

Parameter tree (kernels are [in, out]; H hidden, Nq/Nkv heads, D head dim, I intermediate, V vocab):
  embed_tokens/embedding            [V, H]       (vocab-parallel)
  layers_{i}/input_norm/scale       [H]
  layers_{i}/attn/qkv_proj/kernel   [H, (Nq+2S)*D] q|k|v fused (+ bias for Qwen2 / attention_bias;
                                                 column-parallel; layout: models/fused_projections.py)
  layers_{i}/attn/o_proj/kernel     [Nq*D, H]    (row-parallel)
  layers_{i}/attn/q_norm/scale      [D]          (Qwen3 only)
  layers_{i}/attn/k_norm/scale      [D]          (Qwen3 only)
  layers_{i}/attn/k_scale, v_scale  f32[]        (optional: a checkpoint's FP8 KV-cache scales; 1.0 if absent)
  layers_{i}/post_attn_norm/scale   [H]
  layers_{i}/mlp/gate_up_proj/kernel [H, 2I]     gate|up fused (column-parallel)
  layers_{i}/mlp/down_proj/kernel   [I, H]       (row-parallel)
  norm/scale                        [H]
  lm_head/kernel                    [H, V]       (absent when tie_word_embeddings; vocab-parallel)
With arch.quant or arch.layer_quant (a quantized model), a projection's `kernel` is replaced by its scheme's leaves
(qweight, scales, ...: jaxllm/quantization/scheme.py), laid out and fused the same way along N.
S is the KV heads' slots: Nkv, or the tensor-parallel size N when N > Nkv (each device's K/V head, the one
its query heads read). Checkpoints hold q/k/v and gate/up apart; the loader fuses them (vLLM's layout).
Compute runs in the params' dtype; norm statistics, rotary and softmax in float32.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.layers.attention import kv_cache_scales, paged_attention, paged_attention_qkv
from jaxllm.layers.attention_metadata import AttentionMetadata, KVCache
from jaxllm.layers.linear import linear
from jaxllm.layers.norm import RMSNorm
from jaxllm.layers.rotary import (
    apply_rotary,
    dynamic_ntk_inv_freq,
    longrope_inv_freq,
    longrope_token_inv_freq,
    rope_inv_freq,
)
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fused_projections import FusedGroup, FusedPart, split_columns
from jaxllm.models.layer_trace import call_layer
from jaxllm.models.research_hooks import (
    ResearchInputs,
    apply_edit,
    capture,
    empty_captures,
    head_factors,
    research_tables,
    site_edit,
)
from jaxllm.quantization.scheme import LayerQuant

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "gelu_pytorch_tanh": jax.nn.gelu,
}


def qkv_group(a: ModelArchConfig, shards: int = 1) -> FusedGroup:
    return FusedGroup(
        "attn/qkv_proj",
        (
            FusedPart("attn/q_proj", a.num_heads, a.head_dim),
            FusedPart("attn/k_proj", a.num_kv_heads, a.head_dim),
            FusedPart("attn/v_proj", a.num_kv_heads, a.head_dim),
        ),
        shards,
    )


def gate_up_group(a: ModelArchConfig, shards: int = 1) -> FusedGroup:
    parts = (
        FusedPart("mlp/gate_proj", a.intermediate_size, 1),
        FusedPart("mlp/up_proj", a.intermediate_size, 1),
    )
    return FusedGroup("mlp/gate_up_proj", parts, shards)


def layer_quant(a: ModelArchConfig, i: int) -> LayerQuant:
    return a.layer_quant[i] if a.layer_quant is not None else LayerQuant(a.quant)


def sequence_lengths(md: AttentionMetadata, num_tokens: int) -> jax.Array:  # i32[T]
    """Context length of the sequence each token belongs to (0 for padding rows)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    s = md.kv_lens.shape[0]
    # a vectorised compare, not searchsorted: its binary search is a while loop, which on a GPU reads its
    # condition back to the host every iteration and so stalls the step's dispatch
    ends = md.cu_q_lens[1:]
    seq_of = jnp.minimum(jnp.sum(ends[None, :] <= rows[:, None], axis=1, dtype=jnp.int32), s - 1)
    return md.kv_lens[seq_of]


def tied_or_head_logits(
    hidden: jax.Array, embedding: jax.Array | None, kernel: jax.Array | None
) -> jax.Array:
    """f32[N, V]: hidden [N, H] times lm_head [H, V] (or embedding [V, H] transposed), f32 accumulation."""
    if kernel is not None:
        return jnp.einsum(
            "nh,hv->nv", hidden.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32
        )
    return jnp.einsum(
        "nh,vh->nv", hidden.astype(embedding.dtype), embedding, preferred_element_type=jnp.float32
    )


class LlamaAttention(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    tp_size: int = 1  # shards of the fused q|k|v layout
    quant: LayerQuant = LayerQuant()  # the layer's projections' schemes

    @property
    def use_kernels(self) -> bool:  # a GPU backend: quantized projections may run their Pallas GEMM
        return self.attn_backend != "reference"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        kv_cache: KVCache,  # ([Nkv, P, PS, D], [Nkv, P, PS, D])
        md: AttentionMetadata,
        inv_freq: jax.Array,  # f32[D/2] or f32[T, D/2]
        attention_factor: float,
        head_factor: jax.Array | None = None,  # f32[T, Nq] research: scales each head's output
    ) -> tuple[jax.Array, KVCache]:
        a = self.arch
        t = x.shape[0]
        group = qkv_group(a, self.tp_size)
        qkv = linear(group.width, a.attention_bias, self.quant.get("qkv_proj"), "qkv_proj", self.use_kernels)(
            x
        )
        kw = dict(sm_scale=a.head_dim**-0.5, backend=self.attn_backend, sliding_window=a.sliding_window)
        kw["k_scale"], kw["v_scale"] = kv_cache_scales(self)  # fp8 caches only
        if not a.qk_norm:
            # q and k rotate in place inside the fused array, which attention reads as it is.
            heads = qkv.reshape(t, -1, a.head_dim)  # [T, Hq + 2S, D], shard by shard
            n = self.tp_size
            period, count = heads.shape[1] // n, (a.num_heads + group.parts[1].slots(n)) // n
            heads = apply_rotary(heads, md.positions, inv_freq, attention_factor, rotated=(period, count))
            out, kv_cache = paged_attention_qkv(heads, kv_cache, md, num_q_heads=a.num_heads, **kw)
            out = _scale_heads(out, head_factor, t, a)
            out = linear(a.hidden_size, a.o_proj_bias, self.quant.get("o_proj"), "o_proj", self.use_kernels)(
                out.reshape(t, -1)
            )
            return out, kv_cache
        q, k, v = split_columns(group, qkv)
        q = q.reshape(t, a.num_heads, a.head_dim)
        k = k.reshape(t, -1, a.head_dim)  # [T, S, D]
        v = v.reshape(t, -1, a.head_dim)
        if a.qk_norm:
            q = RMSNorm(a.head_dim, a.rms_norm_eps, name="q_norm")(q)
            k = RMSNorm(a.head_dim, a.rms_norm_eps, name="k_norm")(k)
        q = apply_rotary(q, md.positions, inv_freq, attention_factor)
        k = apply_rotary(k, md.positions, inv_freq, attention_factor)
        out, kv_cache = paged_attention(q, k, v, kv_cache, md, **kw)
        out = _scale_heads(out, head_factor, t, a)
        out = linear(a.hidden_size, a.o_proj_bias, self.quant.get("o_proj"), "o_proj", self.use_kernels)(
            out.reshape(t, -1)
        )
        return out, kv_cache


def _scale_heads(out: jax.Array, head_factor: jax.Array | None, t: int, a: ModelArchConfig) -> jax.Array:
    """The attention output ([T, Nq, D] or [T, Nq * D]) with each head's part scaled by head_factor."""
    if head_factor is None:
        return out
    heads = out.reshape(t, a.num_heads, a.head_dim).astype(jnp.float32) * head_factor[:, :, None]
    return heads.astype(out.dtype).reshape(out.shape)


class LlamaMLP(nn.Module):
    arch: ModelArchConfig
    tp_size: int = 1  # shards of the fused gate|up layout
    use_kernels: bool = False  # quantized projections may run their Pallas GEMM (a GPU backend)
    quant: LayerQuant = LayerQuant()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        a = self.arch
        act = ACTIVATIONS[a.hidden_act]
        group = gate_up_group(a, self.tp_size)
        gate_up = linear(
            group.width, a.mlp_bias, self.quant.get("gate_up_proj"), "gate_up_proj", self.use_kernels
        )(x)
        gate, up = split_columns(group, gate_up)
        return linear(a.hidden_size, a.mlp_bias, self.quant.get("down_proj"), "down_proj", self.use_kernels)(
            act(gate) * up
        )


class LlamaDecoderLayer(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    tp_size: int = 1
    quant: LayerQuant = LayerQuant()

    @nn.compact
    def __call__(self, x, kv_cache, md, inv_freq, edits=None, attention_factor=1.0):  # x: [T, H]
        """(x, kv_cache), or with `edits` (research: (attn SiteEdit, mlp SiteEdit, head factors f32[T, Nq]),
        models/research_hooks.py) (x, kv_cache, attn_out, mlp_out), the block outputs as edited."""
        a = self.arch
        attn_edit, mlp_edit, heads = edits if edits is not None else (None, None, None)
        h, kv_cache = LlamaAttention(a, self.attn_backend, self.tp_size, self.quant, name="attn")(
            RMSNorm(a.hidden_size, a.rms_norm_eps, name="input_norm")(x),
            kv_cache,
            md,
            inv_freq,
            attention_factor,
            heads,
        )
        h = apply_edit(h, attn_edit)
        x = x + h
        m = LlamaMLP(a, self.tp_size, self.attn_backend != "reference", self.quant, name="mlp")(
            RMSNorm(a.hidden_size, a.rms_norm_eps, name="post_attn_norm")(x)
        )
        m = apply_edit(m, mlp_edit)
        x = x + m
        if edits is not None:
            return x, kv_cache, h, m
        return x, kv_cache


class LlamaForCausalLM(nn.Module):
    arch: ModelArchConfig
    attn_backend: str = "reference"
    trace_layers_once: bool = True  # layers share one trace per step shape (models/layer_trace.py)
    tp_size: int = 1  # tensor-parallel shards the fused projections are laid out for
    supports_research = True  # __call__ takes ResearchInputs (captures, steering: models/research_hooks.py)

    def setup(self) -> None:
        a = self.arch
        self.embed_tokens = nn.Embed(a.vocab_size, a.hidden_size)
        self.layers = [self.decoder_layer(i) for i in range(a.num_layers)]
        self.norm = self.final_norm()
        if not a.tie_word_embeddings:
            self.lm_head = nn.Dense(a.vocab_size, use_bias=False)

    def decoder_layer(self, i: int) -> nn.Module:
        """Layer i (unbound, built in setup): what families built on this model (Gemma 3, MoE) replace."""
        return LlamaDecoderLayer(self.arch, self.attn_backend, self.tp_size, layer_quant(self.arch, i))

    def final_norm(self) -> nn.Module:
        return RMSNorm(self.arch.hidden_size, self.arch.rms_norm_eps)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        kv_caches: list[KVCache],  # per layer ([Nkv, P, PS, D], [Nkv, P, PS, D])
        md: AttentionMetadata,
        research: ResearchInputs | None = None,
    ):  # ([T, H], updated caches), and with `research` the captures [C + 1, R, H] (models/research_hooks.py)
        a = self.arch
        rope = a.rope
        inv_freq, attention_factor = rope_inv_freq(a.head_dim, a.rope_theta, rope, a.max_position_embeddings)
        inv_freq = jnp.asarray(inv_freq)
        if rope["rope_type"] == "dynamic":
            seq_lens = sequence_lengths(md, input_ids.shape[0])
            inv_freq = dynamic_ntk_inv_freq(
                seq_lens, a.head_dim, a.rope_theta, float(rope["factor"]), a.max_position_embeddings
            )
        if rope["rope_type"] == "longrope":  # Phi-3: per sequence, short or long factors by its length
            dim = int(a.head_dim * rope.get("partial_rotary_factor", 1.0))
            short, long, _ = longrope_inv_freq(dim, a.rope_theta, rope, a.max_position_embeddings)
            orig = int(rope["original_max_position_embeddings"])
            inv_freq = longrope_token_inv_freq(sequence_lengths(md, input_ids.shape[0]), short, long, orig)
        x = self.embed_tokens(input_ids)
        new_caches = []
        if research is None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, kv_cache = call_layer(
                    self, layer, x, kv_cache, md, inv_freq, attention_factor=attention_factor
                )
                new_caches.append(kv_cache)
            return self.norm(x), new_caches
        n = a.num_layers
        caps = empty_captures(research, a.hidden_size, x.dtype)
        tables = research_tables(research, n, a.num_heads)
        every_site = not research.residual_only
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            edits = (
                (site_edit(tables, n + i), site_edit(tables, 2 * n + i), head_factors(tables, i))
                if every_site
                else (None, None, None)
            )
            x, kv_cache, h, m = call_layer(
                self, layer, x, kv_cache, md, inv_freq, edits, attention_factor=attention_factor
            )
            x = apply_edit(x, site_edit(tables, i))
            captured = ((i, x), (n + i, h), (2 * n + i, m)) if every_site else ((i, x),)
            for code, act in captured:
                caps = capture(caps, tables, code, act)
            new_caches.append(kv_cache)
        x = self.norm(x)
        return x, new_caches, capture(caps, tables, 3 * n, x) if every_site else caps

    def fused_groups(self) -> tuple[FusedGroup, ...]:
        """The fused projections of every layer, for the loader (which gets the checkpoint's parts)."""
        return qkv_group(self.arch, self.tp_size), gate_up_group(self.arch, self.tp_size)

    def init_all(self, input_ids, kv_caches, md):
        """For `init`/`eval_shape`: touches every parameter (the forward pass and the head)."""
        hidden, _ = self(input_ids, kv_caches, md)
        return self.compute_logits(hidden)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, H] -> f32[N, V]
        if self.is_initializing() and not self.arch.tie_word_embeddings:
            self.lm_head(hidden)  # creates the lm_head params
        if self.arch.tie_word_embeddings:
            return tied_or_head_logits(hidden, self.embed_tokens.embedding, None)
        return tied_or_head_logits(hidden, None, self.lm_head.variables["params"]["kernel"])
