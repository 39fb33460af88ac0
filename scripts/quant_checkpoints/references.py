"""What transformers computes with a saved checkpoint, through the loader path a user gets on the CPU:
compressed-tensors checkpoints decompress to dense weights on the first forward (activation quantization
of W8A8/FP8 is still applied, per token, inside each Linear); GPTQ and AWQ load into GPTQModel's torch
kernels. Everything runs in float32 so the numbers reflect the checkpoint, not bf16 rounding.

Three files per checkpoint:
  reference.json              per prompt (token ids): the greedy continuation (chosen token, its logprob,
                              top-5 per step), and the distributions along the base model's greedy
                              continuation (forced_*: teacher-forced, so positions compare one to one)
  tool_metadata.json          the tool's own view of layer 0: each Linear's kernel class and the tensors it
                              allocates (name, dtype, shape) as loaded, plus the quantization config the
                              tool parsed from the folder
  layer0_dense.reference    the tool's own dequantization of layer 0's Linears, f32[N, K] (torch's
                              out x in), to check an independent unpacking against
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from calibration import NUM_NEW_TOKENS, TOP_K
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

LAYER0_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _layer0_tensors(model) -> dict:
    """Each layer-0 Linear's state (parameters and persistent buffers), as its kernel allocated them."""
    layer = model.model.layers[0]
    out = {}
    for name in LAYER0_LINEARS:
        module = layer.get_submodule(name)
        out[name] = {
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "tensors": {
                key: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                for key, t in module.state_dict().items()
            },
        }
    return out


def _tool_quantization_config(folder: Path, config: dict) -> dict | None:
    """The quantization config as the tool that wrote it reads it back (not transformers' copy)."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == "compressed-tensors":
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        qconfig = QuantizationConfig.model_validate(config["quantization_config"])
        names = {}
        for group, scheme in qconfig.config_groups.items():
            fmt = scheme.format or qconfig.format
            names[group] = list(BaseCompressor.get_value_from_registry(fmt).compression_param_names(scheme))
        return {"config": json.loads(qconfig.model_dump_json()), "compression_param_names": names}
    if method in ("gptq", "awq"):
        path = folder / "quantize_config.json"
        return {"config": json.loads(path.read_text())} if path.is_file() else None
    return None


@torch.inference_mode()
def _greedy(model, prompt_ids: list[int]) -> dict:
    """Greedy decoding with the KV cache; every step's distribution comes from float32 logits. The loop
    runs NUM_NEW_TOKENS steps even past an end-of-sequence token, so every prompt has the same length."""
    tokens, logprobs, top_ids, top_logprobs = [], [], [], []
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    for _ in range(NUM_NEW_TOKENS):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # f32[V]
        top = torch.topk(logp, TOP_K)
        token = int(torch.argmax(logp))
        tokens.append(token)
        logprobs.append(float(logp[token]))
        top_ids.append([int(i) for i in top.indices])
        top_logprobs.append([float(v) for v in top.values])
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return {"tokens": tokens, "logprobs": logprobs, "top_ids": top_ids, "top_logprobs": top_logprobs}


@torch.inference_mode()
def _forced(model, prompt_ids: list[int], tokens: list[int]) -> dict:
    """The model's distributions along a given continuation (the base model's greedy one), in one forward
    over prompt + continuation: comparable position by position even where greedy decoding of this model
    went another way after a near tie."""
    ids = torch.tensor([prompt_ids + tokens[:-1]])
    logp = torch.log_softmax(
        model(input_ids=ids).logits[0, len(prompt_ids) - 1 :].float(), dim=-1
    )  # f32[T, V]
    top = torch.topk(logp, TOP_K, dim=-1)
    return {
        "forced_logprobs": [float(logp[i, t]) for i, t in enumerate(tokens)],
        "forced_top_ids": top.indices.tolist(),
        "forced_top_logprobs": top.values.tolist(),
    }


@torch.inference_mode()
def _layer0_dense(model) -> dict[str, torch.Tensor]:
    """Dense f32[N, K] weights of layer 0 as the loaded kernels compute with them. A decompressed
    compressed-tensors Linear holds them as `weight`; a packed kernel (GPTQ, AWQ) is fed the identity, whose
    output rows are the weight's columns in the checkpoint's original input order (act-order included)."""
    layer = model.model.layers[0]
    dense = {}
    for name in LAYER0_LINEARS:
        module = layer.get_submodule(name)
        if isinstance(module, torch.nn.Linear) and module.weight.is_floating_point():
            weight = module.weight.float()
        else:
            k = module.in_features
            weight = module(torch.eye(k, dtype=torch.float32)).float().T
        dense[f"model.layers.0.{name}.weight"] = weight.contiguous()
    return dense


def write_references(folder: Path, prompts: list[dict]) -> dict:
    config = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
    model.eval()
    metadata = {
        "layer0": _layer0_tensors(model),  # before the first forward: as loaded, still compressed
        "quantization_config": _tool_quantization_config(folder, config),
    }
    results = []
    for prompt in prompts:
        result = dict(prompt, **_greedy(model, prompt["prompt_ids"]))
        # The base's own greedy tokens when this is the base: the forced pass then checks the cached
        # decode against a full forward.
        base_tokens = prompt.get("base_tokens", result["tokens"])
        result.update(_forced(model, prompt["prompt_ids"], base_tokens))
        result["base_tokens"] = base_tokens
        results.append(result)
    save_file(_layer0_dense(model), str(folder / "layer0_dense.reference"))
    metadata["layer0_class_after_forward"] = {
        name: type(model.model.layers[0].get_submodule(name)).__qualname__ for name in LAYER0_LINEARS
    }
    (folder / "tool_metadata.json").write_text(json.dumps(metadata, indent=1) + "\n")
    reference = {
        "compute_dtype": "float32",
        "num_new_tokens": NUM_NEW_TOKENS,
        "top_k": TOP_K,
        "loader": "transformers.AutoModelForCausalLM.from_pretrained(dtype=float32, device_map='cpu')",
        "prompts": results,
    }
    (folder / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    return reference
