"""Checkpoint tensor names -> our parameter paths ("layers_3/attn/q_proj/kernel").

Each mapper returns (path, transpose) or None for tensors we deliberately skip (rotary caches, a tied
lm_head). PyTorch/GGUF linear weights are [out, in]; our kernels are [in, out], hence `transpose`.
An unknown name raises ValueError naming it, so a wrong checkpoint fails loudly.
"""

from __future__ import annotations

import re

from jaxllm.models.config import ModelArchConfig

Mapped = tuple[str, bool] | None

_LLAMA_LAYER = {
    "input_layernorm.weight": ("input_norm/scale", False),
    "post_attention_layernorm.weight": ("post_attn_norm/scale", False),
    "self_attn.q_norm.weight": ("attn/q_norm/scale", False),
    "self_attn.k_norm.weight": ("attn/k_norm/scale", False),
    "self_attn.k_scale": ("attn/k_scale", False),  # FP8 KV-cache scales (compressed-tensors)
    "self_attn.v_scale": ("attn/v_scale", False),
    "pre_feedforward_layernorm.weight": ("pre_ffw_norm/scale", False),  # Gemma 3
    "post_feedforward_layernorm.weight": ("post_ffw_norm/scale", False),
    # Phi-3: q|k|v and gate|up held whole; the loader cuts them into the parts (params_builder.py)
    "self_attn.qkv_proj.weight": ("attn/qkv_proj/kernel", True),
    "mlp.gate_up_proj.weight": ("mlp/gate_up_proj/kernel", True),
}
for _p in ("q", "k", "v", "o"):
    _LLAMA_LAYER[f"self_attn.{_p}_proj.weight"] = (f"attn/{_p}_proj/kernel", True)
    _LLAMA_LAYER[f"self_attn.{_p}_proj.bias"] = (f"attn/{_p}_proj/bias", False)
for _p in ("gate", "up", "down"):
    _LLAMA_LAYER[f"mlp.{_p}_proj.weight"] = (f"mlp/{_p}_proj/kernel", True)
    _LLAMA_LAYER[f"mlp.{_p}_proj.bias"] = (f"mlp/{_p}_proj/bias", False)

_OPT_LAYER = {
    "self_attn_layer_norm.weight": ("attn_norm/scale", False),
    "self_attn_layer_norm.bias": ("attn_norm/bias", False),
    "final_layer_norm.weight": ("mlp_norm/scale", False),
    "final_layer_norm.bias": ("mlp_norm/bias", False),
}
for _p, _o in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")):
    _OPT_LAYER[f"self_attn.{_p}_proj.weight"] = (f"attn/{_o}_proj/kernel", True)
    _OPT_LAYER[f"self_attn.{_p}_proj.bias"] = (f"attn/{_o}_proj/bias", False)
for _p in ("fc1", "fc2"):
    _OPT_LAYER[f"{_p}.weight"] = (f"mlp/{_p}/kernel", True)
    _OPT_LAYER[f"{_p}.bias"] = (f"mlp/{_p}/bias", False)

_LAYER_RE = re.compile(r"^(?:model\.)?(?:decoder\.)?layers\.(\d+)\.(.+)$")


def _unknown(name: str) -> ValueError:
    return ValueError(f"unexpected tensor {name!r} in the checkpoint (not part of this architecture)")


def llama_hf_name(name: str, arch: ModelArchConfig) -> Mapped:
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight":
        return None if arch.tie_word_embeddings else ("lm_head/kernel", True)
    top = {
        "model.embed_tokens.weight": ("embed_tokens/embedding", False),
        "model.norm.weight": ("norm/scale", False),
    }
    if name in top:
        return top[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LLAMA_LAYER:
        path, t = _LLAMA_LAYER[m.group(2)]
        return f"layers_{m.group(1)}/{path}", t
    raise _unknown(name)


def opt_hf_name(name: str, arch: ModelArchConfig) -> Mapped:
    name = name.removeprefix("model.")
    if name == "lm_head.weight":
        return None if arch.tie_word_embeddings else ("lm_head/kernel", True)
    top = {
        "decoder.embed_tokens.weight": ("embed_tokens/embedding", False),
        "decoder.embed_positions.weight": ("embed_positions/embedding", False),
        "decoder.project_in.weight": ("project_in/kernel", True),
        "decoder.project_out.weight": ("project_out/kernel", True),
        "decoder.final_layer_norm.weight": ("final_norm/scale", False),
        "decoder.final_layer_norm.bias": ("final_norm/bias", False),
    }
    if name in top:
        return top[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _OPT_LAYER:
        path, t = _OPT_LAYER[m.group(2)]
        return f"layers_{m.group(1)}/{path}", t
    raise _unknown(name)


# a sparse layer's router and experts: Mixtral's block_sparse_moe.{gate, experts.E.w1|w3|w2} and
# Qwen3-MoE's mlp.{gate, experts.E.gate_proj|up_proj|down_proj}
_MOE_ROUTER = ("block_sparse_moe.gate.weight", "mlp.gate.weight")
_MOE_EXPERT = re.compile(
    r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_hf_name(name: str, arch: ModelArchConfig) -> Mapped:
    """Mixtral and Qwen3-MoE: the Llama names, plus the router (layers_{i}/mlp/gate/kernel) and one path
    per expert, layers_{i}/mlp/experts/{e}/{gate,up,down}_proj/kernel, which ParamsBuilder stacks into
    the [E, ...] weights of models/moe_llama.py."""
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _MOE_ROUTER:
        return f"layers_{m.group(1)}/mlp/gate/kernel", True
    e = _MOE_EXPERT.match(m.group(2)) if m else None
    if e:
        proj = _EXPERT_PROJ.get(e.group(2), e.group(2))
        return f"layers_{m.group(1)}/mlp/experts/{e.group(1)}/{proj}/kernel", True
    return llama_hf_name(name, arch)


def hf_name_mapper(arch: ModelArchConfig):
    if arch.architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return moe_hf_name
    return opt_hf_name if arch.architecture == "OPTForCausalLM" else llama_hf_name


_GGUF_LAYER = {
    "attn_norm.weight": ("input_norm/scale", False),
    "ffn_norm.weight": ("post_attn_norm/scale", False),
    "attn_q_norm.weight": ("attn/q_norm/scale", False),
    "attn_k_norm.weight": ("attn/k_norm/scale", False),
    "attn_output.weight": ("attn/o_proj/kernel", True),
    "attn_output.bias": ("attn/o_proj/bias", False),
    "ffn_gate.weight": ("mlp/gate_proj/kernel", True),
    "ffn_up.weight": ("mlp/up_proj/kernel", True),
    "ffn_down.weight": ("mlp/down_proj/kernel", True),
}
for _p in ("q", "k", "v"):
    _GGUF_LAYER[f"attn_{_p}.weight"] = (f"attn/{_p}_proj/kernel", True)
    _GGUF_LAYER[f"attn_{_p}.bias"] = (f"attn/{_p}_proj/bias", False)
# Gemma 3 norms around the attention and the MLP (llama.cpp names; ffn_norm is the pre-MLP norm)
_GGUF_GEMMA3_LAYER = {
    "post_attention_norm.weight": ("post_attn_norm/scale", False),
    "ffn_norm.weight": ("pre_ffw_norm/scale", False),
    "post_ffw_norm.weight": ("post_ffw_norm/scale", False),
}
_GGUF_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_name(name: str, arch: ModelArchConfig) -> Mapped:
    """GGUF (llama.cpp) tensor names for the Llama family: token_embd, blk.N.attn_q, ..., output."""
    if name.startswith("rope_"):
        return None
    top = {
        "token_embd.weight": ("embed_tokens/embedding", False),
        "output_norm.weight": ("norm/scale", False),
    }
    if name in top:
        return top[name]
    if name == "output.weight":
        return None if arch.tie_word_embeddings else ("lm_head/kernel", True)
    m = _GGUF_BLK_RE.match(name)
    layer_names = _GGUF_LAYER
    if arch.architecture == "Gemma3ForCausalLM":
        layer_names = {**_GGUF_LAYER, **_GGUF_GEMMA3_LAYER}
    if m and m.group(2) in layer_names:
        path, t = layer_names[m.group(2)]
        return f"layers_{m.group(1)}/{path}", t
    raise _unknown(name)
