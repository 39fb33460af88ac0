"""GGUF file (llama.cpp) -> (HF-style config dict, params), for the Llama family (llama, mistral, qwen2,
qwen3 metadata) and Gemma 3 (gemma3: its norm weights are stored plus one, which the load takes off).

Header: `GGUFHeader` (gguf_header.py) memory-maps the file; `{arch}.*` metadata becomes an HF config dict
(`gguf_hf_config`), which also records the GGUF type of every decoder projection's parts
(`gguf_projection_types`), so a model restored from the orbax cache is built the same way.

Schemes (as vLLM serves GGUF: quantized): per layer and projection (q|k|v fused in qkv_proj, gate|up in
gate_up_proj), parts all Q4_0 / Q4_1 / Q4_K -> int4 W4A16 g32; all Q8_0 -> int8 W8A16 g32; mixed or any
other type (Q6_K, Q5_K, F16, ...) -> float, dequantized (`gguf_layer_quant` -> arch.layer_quant).

Tensors, one at a time: a served projection's raw blocks -> the canonical leaves (gguf_blocks.py), any
other tensor -> `gguf.quants.dequantize` -> float32 [out, in]; then llama.cpp's Q/K rotary row permutation
is undone on every leaf's rows (llama/mistral only, as transformers' GGUF loader does) -> ParamsBuilder
(cast to the target dtype, transpose, device_put). The host copy is dropped per tensor.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

import numpy as np

from jaxllm.loader.gguf_blocks import GROUP, INT4_TYPES, INT8_TYPES, decode_quantized
from jaxllm.loader.gguf_header import GGUFHeader
from jaxllm.loader.names import gguf_name
from jaxllm.loader.params_builder import ParamsBuilder, ShardingFn
from jaxllm.models.config import ModelArchConfig
from jaxllm.quantization.scheme import LayerQuant, QuantScheme

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp's converter stores Gemma's zero-centred norm weights plus one; the model adds the one itself
_NORM_SHIFTED = ("gemma3",)
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
# a decoder layer's projections and the GGUF tensors that make each (in the fused weight's part order)
GGUF_PROJECTIONS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
_PART_PROJECTION = {part: proj for proj, parts in GGUF_PROJECTIONS.items() for part in parts}
_BLOCK_WEIGHT = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
GGUF_INT4 = QuantScheme("gguf", "int4", group_size=GROUP)
GGUF_INT8 = QuantScheme("gguf", "int8", group_size=GROUP)


def open_gguf(path: str) -> GGUFHeader:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return GGUFHeader(path)
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
        "torch_dtype": "float32",  # what dequantized tensors (and the int scales' f16) are exact in
        # kept with the config, so a model restored from the orbax cache still has them
        "gguf_generation_config": gguf_generation_config(reader),
        "gguf_projection_types": gguf_projection_types(reader, int(get("block_count"))),
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
    if arch == "gemma3":
        cfg.update(gemma3_gguf_fields(get, cfg))
    return cfg


def gemma3_gguf_fields(get, cfg: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves to the reader, as llama.cpp fills it in: every 6th layer global, the
    sliding layers' rotary base 10,000 (unscaled), the attention scale 1/sqrt(head_dim) except for the
    62-layer 27B, whose is 1/sqrt(hidden / heads); the MLP's tanh GELU; tied embeddings."""
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    swa = get("attention.sliding_window_pattern", 6)  # newer files: one bool per layer (True: sliding)
    if isinstance(swa, list):
        kinds = {"layer_types": ["sliding_attention" if s else "full_attention" for s in swa]}
    else:
        kinds = {"sliding_window_pattern": int(swa)}
    return {
        **kinds,
        "sliding_window": int(get("attention.sliding_window")),
        "rope_local_base_freq": float(get("rope.freq_base_swa", 10_000.0)),
        "query_pre_attn_scalar": hidden // heads if n == 62 else cfg["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": get("final_logit_softcapping"),
    }


def gguf_generation_config(reader) -> dict[str, Any]:
    """The file's general.sampling.* keys, named as in generation_config.json (empty when it has none)."""
    out = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = _field(reader, key)
        if value is not None:
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def gguf_projection_types(reader, num_layers: int) -> list[dict[str, list[str]]]:
    """Per layer, {projection: the GGUF type names of its parts} ("missing" for a part not in the file)."""
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return [
        {
            proj: [types.get(f"blk.{i}.{part}.weight", "missing") for part in parts]
            for proj, parts in GGUF_PROJECTIONS.items()
        }
        for i in range(num_layers)
    ]


def projection_scheme(types: list[str]) -> QuantScheme | None:
    """A fused projection is served int4 (or int8) only when all its parts are: one weight, one layout."""
    if all(t in INT4_TYPES for t in types):
        return GGUF_INT4
    if all(t in INT8_TYPES for t in types):
        return GGUF_INT8
    return None


def gguf_layer_quant(hf_config: dict, path: str) -> tuple[LayerQuant, ...] | None:
    """arch.layer_quant of a GGUF model (None when every projection is dequantized: a float model)."""
    types = hf_config.get("gguf_projection_types")
    if types is None:
        raise ValueError(f"{path}: the config read from the GGUF header lacks gguf_projection_types")
    layers = tuple(
        LayerQuant(overrides=tuple((proj, projection_scheme(t)) for proj, t in layer.items()))
        for layer in types
    )
    if all(s is None for lq in layers for _, s in lq.overrides):
        return None
    return layers


def describe_projections(hf_config: dict) -> str:
    """One log line: which projections are served int4 / int8 and which dequantized, with types and counts
    ("int4 W4A16 g32: qkv_proj[Q4_1] x30, ...; dequantized: down_proj[Q6_K] x30")."""
    served: dict[str, Counter] = {}
    for layer in hf_config["gguf_projection_types"]:
        for proj, types in layer.items():
            scheme = projection_scheme(types)
            kind = scheme.describe().removeprefix("gguf: ") if scheme else "dequantized"
            served.setdefault(kind, Counter())[f"{proj}[{'+'.join(types)}]"] += 1
    order = sorted(served, key=lambda k: k == "dequantized")
    return "; ".join(f"{k}: " + ", ".join(f"{p} x{n}" for p, n in served[k].items()) for k in order)


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
        target, transpose = mapped
        scheme = _tensor_scheme(tensor.name, arch)
        if scheme is None:
            leaves = {target: dequantize_tensor(tensor, path)}
        else:
            base = target.removesuffix("kernel")
            leaves = {base + k: v for k, v in quantized_leaves(tensor, scheme, path).items()}
        if gguf_arch in _NORM_SHIFTED and tensor.name.endswith("norm.weight"):
            leaves = {k: v - 1.0 for k, v in leaves.items()}
        if gguf_arch in _PERMUTED_QK and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
            n = arch.num_heads if ".attn_q." in tensor.name else arch.num_kv_heads
            leaves = {k: unpermute_qk(v, n) for k, v in leaves.items()}  # rows = outputs, in every leaf
        for leaf_path, x in leaves.items():
            builder.put(leaf_path, x, transpose=transpose, tensor_name=tensor.name)
        del leaves
    return builder.finish()


def _tensor_scheme(name: str, arch: ModelArchConfig) -> QuantScheme | None:
    """The scheme the model holds the projection of tensor `name` in (None: float, or not a projection)."""
    m = _BLOCK_WEIGHT.match(name)
    if arch.layer_quant is None or m is None or m.group(2) not in _PART_PROJECTION:
        return None
    return arch.layer_quant[int(m.group(1))].get(_PART_PROJECTION[m.group(2)])


def quantized_leaves(tensor, scheme: QuantScheme, path: str) -> dict[str, np.ndarray]:
    """The canonical leaves of a projection tensor, [out, ...] like the file's rows (gguf_blocks.py)."""
    qtype = tensor.tensor_type.name
    if qtype not in (INT4_TYPES if scheme.weights == "int4" else INT8_TYPES):
        raise ValueError(
            f"{path}: tensor {tensor.name!r} is {qtype}, but the model holds it as {scheme.describe()}"
        )
    return decode_quantized(tensor.data, qtype)
