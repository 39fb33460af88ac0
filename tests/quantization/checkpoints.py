"""Quantized checkpoints of a transformers Llama, written by the tests' own quantizer and packers.

`write_quantized(model, folder, method)` rounds every decoder projection (q/k/v/o, gate/up/down) to
codes with numpy, packs them as AutoAWQ, GPTQ or compressed-tensors would (tests/quantization/packers.py),
saves them with the float tensors (embeddings, norms, LM head) and a config.json carrying the method's
quantization_config, and returns the float weights the codes stand for: put into the transformers model
(`with_weights`), they make the reference that jaxllm's loaded model must match. The rounding itself need
not be good: the reference is whatever the codes dequantize to.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np

from tests.quantization import packers

# each decoder projection of a HF Llama, and which input it reads (projections that jaxllm fuses read
# the same input, so GPTQ's act order is the same for them)
PROJECTIONS = {
    "self_attn.q_proj": "attn_in",
    "self_attn.k_proj": "attn_in",
    "self_attn.v_proj": "attn_in",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "mlp_in",
    "mlp.up_proj": "mlp_in",
    "mlp.down_proj": "mlp_out",
}

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}
GPTQ_CONFIG = {
    "quant_method": "gptq",
    "bits": 4,
    "sym": False,
    "static_groups": False,
    "true_sequential": True,
}
CT_W8A8_INT8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {
                "num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True
            },
        }
    },
}  # fmt: skip


CT_W4A16_ASYM = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": False, "dynamic": False},
            "input_activations": None,
        }
    },
}  # fmt: skip


def decoder_projections(model):
    """(checkpoint module name, torch Linear, input kind) of every decoder projection."""
    for i, layer in enumerate(model.model.layers):
        for rel, kind in PROJECTIONS.items():
            parent, attr = rel.split(".")
            yield f"model.layers.{i}.{rel}", getattr(getattr(layer, parent), attr), (i, kind)


def quantize_int4(w: np.ndarray, g_idx: np.ndarray, zero_min: int = 0):
    """w f32[K, N] -> (codes u8[K, N], zeros u8[G, N], scales f32[G, N]) round to nearest per group of rows
    (g_idx[k]: the group of row k); scales exactly representable in float16 (the checkpoints' dtype)."""
    groups = int(g_idx.max()) + 1
    k, n = w.shape
    q = np.zeros((k, n), np.uint8)
    z = np.zeros((groups, n), np.uint8)
    s = np.zeros((groups, n), np.float32)
    for j in range(groups):
        rows = g_idx == j
        lo = np.minimum(w[rows].min(axis=0), 0)
        hi = np.maximum(w[rows].max(axis=0), 0)
        s[j] = np.maximum((hi - lo) / 15, 1e-4).astype(np.float16).astype(np.float32)
        z[j] = np.clip(np.round(-lo / s[j]), zero_min, 15)
        q[rows] = np.clip(np.round(w[rows] / s[j]) + z[j], 0, 15)
    return q, z, s


def write_quantized(model, folder: str, method: str, group: int = 32, act_order: bool = False, seed: int = 0,
                    drop: str | None = None, input_scales: dict | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """Save `model` quantized by `method` ("awq", "gptq", "gptq_v2", "ct-w4a16",
    "ct-w8a8-int8", "fp8-static") to `folder`; returns
    {module name: float weight [N, K] the codes dequantize to}. `drop` leaves one tensor out (bad input);
    `input_scales` receives the static input scale of each module ("fp8-static")."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors: dict[str, np.ndarray] = {}
    restored: dict[str, np.ndarray] = {}
    orders: dict = {}  # act order per (layer, input kind)
    for name, linear, key in decoder_projections(model):
        del state[f"{name}.weight"]
        w = linear.weight.detach().float().numpy().T.copy()  # [K, N]
        k = w.shape[0]
        if method == "fp8-static":  # the HF/vLLM fp8 format: per-tensor weight and input scales
            sw = np.float32(np.abs(w).max() / 448)
            q = (w / sw).astype(packers.FP8)  # [K, N]
            si = np.float32(rng.uniform(0.01, 0.03))
            parts = {"weight": q.T.copy(), "weight_scale": sw, "input_scale": si}
            restored[name] = (q.astype(np.float32) * sw).T
            if input_scales is not None:
                input_scales[name] = float(si)
        elif method == "ct-w8a8-int8":
            s = np.abs(w).max(axis=0) / 127  # [N]
            q = np.clip(np.round(w / s), -127, 127).astype(np.int8)
            parts = {"weight": q.T.copy(), "weight_scale": s.astype(np.float32)[:, None]}
            restored[name] = (q.astype(np.float32) * s.astype(np.float32)).T
        else:
            if act_order:
                g_idx = orders.setdefault(key, packers.act_order_g_idx(rng, k, group))
            else:
                g_idx = np.arange(k, dtype=np.int32) // group
            q, z, s = quantize_int4(w, g_idx, zero_min=1 if method == "gptq" else 0)
            if method == "awq":
                parts = packers.awq_checkpoint(q, z, s)
            elif method == "ct-w4a16":  # signed codes and zero points (q - 8, z - 8), torch layout
                gi = g_idx if act_order else None
                parts = packers.ct_pack_quantized(q.T.astype(np.int64) - 8, s.T, z.T.astype(np.int64) - 8, gi)
            else:
                parts = packers.gptq_checkpoint(q, z, s, g_idx, version=1 if method == "gptq" else 2)
            restored[name] = packers.int4_weight(q, z, s, g_idx).T
        for suffix, x in parts.items():
            tensors[f"{name}.{suffix}"] = x
    tensors.update(state)
    if drop is not None:
        del tensors[drop]
    from safetensors.numpy import save_file

    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(folder, "model.safetensors")
    )
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # set by save_pretrained, absent from a fresh model
    if method == "awq":
        qc = dict(AWQ_CONFIG, group_size=group)
    elif method.startswith("gptq"):
        qc = dict(GPTQ_CONFIG, group_size=group, desc_act=act_order, checkpoint_format=method)
    elif method == "fp8-static":
        qc = {"quant_method": "fp8", "activation_scheme": "static"}
    elif method == "ct-w4a16":
        qc = copy.deepcopy(CT_W4A16_ASYM)
        weights = qc["config_groups"]["group_0"]["weights"]
        weights.update(group_size=group, actorder="group" if act_order else None)
    else:
        qc = copy.deepcopy(CT_W8A8_INT8)
    config["quantization_config"] = qc
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return restored


def with_weights(model, weights: dict[str, np.ndarray]):
    """A copy of the transformers model whose projections hold `weights` ([N, K] each)."""
    import torch

    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            modules[name].weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return out
