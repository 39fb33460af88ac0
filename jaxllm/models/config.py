"""`ModelArchConfig`: the architecture facts a model needs, read once from a Hugging Face config.

hf config (PretrainedConfig or dict, old `rope_scaling`/`rope_theta` or new `rope_parameters` form)
  -> `ModelArchConfig.from_hf` -> frozen dataclass (hashable: it is a static field of the Flax module).
GGUF metadata is first translated to an HF-style dict by jaxllm/loader/gguf_loader.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxllm.quantization.scheme import LayerQuant, QuantScheme

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("sliding_attention", "full_attention")
# multimodal checkpoints whose text model jaxllm would serve, with what to use instead
_REFUSED = {
    "Gemma3ForConditionalGeneration": "this is Gemma 3's multimodal checkpoint (vision tower and text model); "
    "jaxllm serves Gemma 3's text model: use a Gemma3ForCausalLM checkpoint (gemma-3-270m, gemma-3-1b) "
    "or a GGUF file of the model",
}


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise ValueError(f"hf_config must be a dict or a transformers PretrainedConfig, got {type(hf_config)}")


def _rope_params(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope_theta, sorted scaling items) from either config form; rope_type 'default' means no scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)) or 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    merged.pop("type", None)
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type == "longrope":
        if merged.get("original_max_position_embeddings") is None:
            merged["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings")
        missing = [
            k
            for k in ("short_factor", "long_factor", "original_max_position_embeddings")
            if not merged.get(k)
        ]
        if missing:
            raise ValueError(f"rope_scaling with rope_type='longrope' needs {', '.join(missing)}")
    merged["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")

    def freeze(v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    return theta, tuple(sorted((k, freeze(v)) for k, v in merged.items()))


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's torch_dtype, e.g. "bfloat16"
    # Llama family (Llama, Mistral, Qwen2, Qwen3)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = (("rope_type", "default"),)
    attention_bias: bool = False  # bias on q/k/v (Qwen2, some Llamas)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    final_layer_norm: bool = True
    # how the decoder layers' projections hold their weights (None: in the compute dtype); set by the
    # loader from config.json's quantization_config or --quantization (jaxllm/quantization/)
    quant: QuantScheme | None = None
    # per decoder layer, when the checkpoint's layers differ (GGUF types vary by tensor); overrides quant
    layer_quant: tuple[LayerQuant, ...] | None = None
    # the checkpoint's per-layer FP8 KV-cache scales (compressed-tensors kv_cache_scheme): attn/k_scale,
    # attn/v_scale params that an fp8 KV cache divides by
    kv_cache_scales: bool = False
    # mixture of experts (Mixtral, Qwen3-MoE; 0 experts: a dense model): layers/moe.py
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1 (Mixtral: always)
    dense_mlp_layers: tuple[int, ...] = ()  # layers with a dense MLP of intermediate_size (Qwen3-MoE)
    # Gemma 3: sliding-window ("sliding_attention") and global ("full_attention") layers interleave;
    # None: every layer alike (sliding_window, if set, applies to all)
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # rotary base of the sliding layers (rope_local_base_freq)
    query_pre_attn_scalar: float | None = None  # attention scale scalar**-0.5 (None: head_dim**-0.5)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        bad = sorted(set(self.layer_types or ()) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types holds {bad}; each layer must be one of {LAYER_TYPES}")
        if "sliding_attention" in (self.layer_types or ()) and not self.sliding_window:
            raise ValueError(
                f"layer_types has sliding_attention layers but sliding_window={self.sliding_window}"
            )

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelArchConfig:
        cfg = _as_dict(hf_config)
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config has no 'architectures' entry; cannot tell which model to build")
        arch = archs[0]
        if arch in _REFUSED:
            raise ValueError(f"architectures={archs}: {_REFUSED[arch]}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        dtype = str(dtype).removeprefix("torch.")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg.get("num_attention_heads"))
        common = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
        )
        if arch == "OPTForCausalLM":
            proj = cfg.get("word_embed_proj_dim") or hidden
            return cls(
                **common,
                intermediate_size=int(cfg["ffn_dim"]),
                num_kv_heads=heads,
                head_dim=hidden // heads,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                hidden_act=cfg.get("activation_function", "relu"),
                do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
                word_embed_proj_dim=int(proj),
                enable_bias=bool(cfg.get("enable_bias", True)),
                layer_norm_elementwise_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
                final_layer_norm=bool(cfg.get("do_layer_norm_before", True))
                and not bool(cfg.get("_remove_final_layer_norm", False)),
            )
        if arch == "Gemma3ForCausalLM":
            return cls(**common, **_gemma3_fields(cfg, hidden, heads))
        theta, scaling = _rope_params(cfg)
        partial = float(cfg.get("partial_rotary_factor") or dict(scaling).get("partial_rotary_factor") or 1.0)
        if partial != 1.0:  # rotary on the first part of each head only (Phi-4-mini)
            if dict(scaling)["rope_type"] == "dynamic":
                raise ValueError(f"partial_rotary_factor={partial} with rope_type 'dynamic' is not supported")
            scaling = tuple(sorted({**dict(scaling), "partial_rotary_factor": partial}.items()))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            **common,
            **_moe_fields(cfg, arch, common["num_layers"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False)) and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            hidden_act=cfg.get("hidden_act", "silu"),
        )


def _moe_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of Mixtral and Qwen3-MoE configs ({} for dense models).

    Qwen3-MoE layer i has experts unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    (transformers' rule); the others keep a dense MLP of intermediate_size."""
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=int(cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
        )
    if arch != "Qwen3MoeForCausalLM":
        return {}
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes the latter
    if experts is None:
        raise ValueError("Qwen3MoeForCausalLM config has no num_experts")
    step = cfg.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be >= 1")
    only = [int(i) for i in cfg.get("mlp_only_layers") or []]
    if any(not 0 <= i < num_layers for i in only):
        raise ValueError(f"mlp_only_layers={only} must hold layer indices in 0..{num_layers - 1}")
    dense = tuple(i for i in range(num_layers) if int(experts) == 0 or i in only or (i + 1) % step)
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        dense_mlp_layers=dense,
    )


def _gemma3_fields(cfg: dict[str, Any], hidden: int, heads: int) -> dict[str, Any]:
    """Gemma 3's fields, from either config form: transformers 5's rope_parameters keyed by layer type
    ({"full_attention": {...}, "sliding_attention": {...}}) or the hub's rope_theta / rope_local_base_freq /
    rope_scaling (which scales the global layers only); layer_types or, without it, sliding_window_pattern
    (every pattern-th layer is global)."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention=True (an embedding model) is not supported: jaxllm generates"
        )
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = _rope_params({"rope_parameters": params["full_attention"]})
        local_theta, local = _rope_params({"rope_parameters": params.get("sliding_attention") or {}})
    else:
        theta, scaling = _rope_params({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
        local_theta, local = float(cfg.get("rope_local_base_freq", 10_000.0)), (("rope_type", "default"),)
    if dict(local)["rope_type"] != "default":
        raise ValueError(
            f"rope_parameters.sliding_attention={dict(local)}: only rope_type 'default' is supported"
        )
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={n}")
    # attn_logit_softcapping is read by transformers' Gemma 3 but never applied (Gemma 3 replaced Gemma 2's
    # attention soft-cap with the q/k norms), so it is ignored here too
    cap = cfg.get("final_logit_softcapping")
    return dict(
        intermediate_size=int(cfg["intermediate_size"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        sliding_window=cfg.get("sliding_window"),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        layer_types=tuple(layer_types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=None if cap is None else float(cap),
    )
