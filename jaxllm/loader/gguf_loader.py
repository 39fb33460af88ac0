"""GGUF file (llama.cpp) -> (HF-style config dict, params), for the Llama family (llama, mistral, qwen2,
qwen3 metadata).

Header: `gguf.GGUFReader` memory-maps the file; `{arch}.*` metadata becomes an HF config dict
(`gguf_hf_config`). Tensors: one at a time, `gguf.quants.dequantize` -> float32 numpy [out, in] -> undo
llama.cpp's Q/K rotary row permutation (llama/mistral only, as transformers' GGUF loader does) ->
ParamsBuilder (cast to the target dtype, transpose, device_put). The host copy is dropped per tensor.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxllm.loader.names import gguf_name
from jaxllm.loader.params_builder import ParamsBuilder, ShardingFn
from jaxllm.models.config import ModelArchConfig

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED_QK = ("llama", "mistral")  # llama.cpp's converter permutes Q/K rows only for these
# llama.cpp's recommended-sampling metadata -> generation_config.json's names (the ones jaxllm takes as
# request defaults; config.GENERATION_CONFIG_FIELDS)
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def open_gguf(path: str):
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_hf_config(reader, path: str) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "gguf_architecture": arch,
        "vocab_size": int(get("vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",  # dequantized
        # kept with the config, so a model restored from the orbax cache still has them
        "gguf_generation_config": gguf_generation_config(reader),
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor"))}
        if scaling_type == "yarn":
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length")
            )
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: rope scaling type {scaling_type!r} is not supported")
    return cfg


def gguf_generation_config(reader) -> dict[str, Any]:
    """The file's general.sampling.* keys, named as in generation_config.json (empty when it has none)."""
    out = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = _field(reader, key)
        if value is not None:
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves: rows (head, pair, 2) -> (head, 2, pair)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor, path: str) -> np.ndarray:  # f32, numpy layout [out, in]
    import gguf

    try:
        return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} uses quant type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from None


def load_gguf_params(
    reader,
    path: str,
    arch: ModelArchConfig,
    gguf_arch: str,
    abstract: dict,
    sharding_fn: ShardingFn | None = None,
    fused_groups: tuple = (),
) -> dict:
    builder = ParamsBuilder(abstract, path, sharding_fn, fused_groups, arch.quant)
    for tensor in reader.tensors:
        mapped = gguf_name(tensor.name, arch)
        if mapped is None:
            continue
        w = dequantize_tensor(tensor, path)
        if gguf_arch in _PERMUTED_QK and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
            n = arch.num_heads if ".attn_q." in tensor.name else arch.num_kv_heads
            w = unpermute_qk(w, n)
        builder.put(mapped[0], w, transpose=mapped[1], tensor_name=tensor.name)
        del w
    return builder.finish()
