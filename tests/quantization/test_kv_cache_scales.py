"""A compressed-tensors checkpoint's FP8 KV-cache scales (kv_cache_scheme) reach the cache writes.

The checkpoint: a tiny float Llama plus per-layer `self_attn.k_scale` / `v_scale` tensors and a
kv_cache_scheme in its quantization_config (what llm-compressor writes for a KV-cache-only recipe).
The fp8 pages must hold clip(k / k_scale, +-448): with a scale of 2^-10 the stored keys are the unit-scale
ones shifted by 10 binary places and clipped at e4m3's largest value.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxllm import LLM, SamplingParams
from jaxllm.quantization.config import QuantConfigError, checkpoint_kv_cache_scales
from tests.quantization.test_quantized_model import float_folder, hf_model  # noqa: F401

KV_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}


def kv_scaled_folder(src: str, dst: str, k_scale: float, v_scale: float) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": KV_SCHEME}  # fmt: skip
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k_scale, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(v_scale, np.float32)
    save_file(tensors, os.path.join(dst, "kv_scales.safetensors"))
    return dst


def k_pages_after_prefill(folder: str) -> np.ndarray:
    llm = LLM(folder, kv_cache_dtype="fp8", dtype="float32", max_model_len=64, compile_ahead=False)
    llm.generate(None, SamplingParams(max_tokens=1), prompt_token_ids=[[5, 6, 7, 8, 9, 10, 11, 12]])
    runner = llm.llm_engine.runner
    params = runner.params
    scales = (float(params["layers_0"]["attn"]["k_scale"]), float(params["layers_0"]["attn"]["v_scale"]))
    return np.asarray(runner.kv_caches[0][0].astype(jnp.float32)), scales


def test_checkpoint_kv_scales_are_loaded_and_used(float_folder, tmp_path):  # noqa: F811
    scaled, scales = k_pages_after_prefill(kv_scaled_folder(float_folder, str(tmp_path / "s"), 2**-10, 0.5))
    unit, unit_scales = k_pages_after_prefill(kv_scaled_folder(float_folder, str(tmp_path / "u"), 1.0, 1.0))
    assert scales == (2**-10, 0.5) and unit_scales == (1.0, 1.0)
    assert 0 < np.abs(unit).max() < 448.0
    # dividing by a power of two only shifts e4m3's exponent: stored = clip(k * 1024) exactly, wherever
    # the unit-scale value is a normal e4m3 number
    normal = np.abs(unit) >= 2**-6
    np.testing.assert_array_equal(scaled[normal], np.clip(unit[normal] * 1024, -448, 448))
    assert np.mean(np.abs(scaled[normal]) == 448.0) > 0.2


def test_kv_cache_scheme_that_is_not_fp8_per_tensor_names_the_field():
    cfg = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "kv_cache_scheme": dict(KV_SCHEME, num_bits=4, type="int"),
        }
    }
    with pytest.raises(QuantConfigError, match="kv_cache_scheme.type"):
        checkpoint_kv_cache_scales(cfg, "m")
    cfg["quantization_config"]["kv_cache_scheme"] = dict(KV_SCHEME, strategy="head")
    with pytest.raises(QuantConfigError, match="kv_cache_scheme.strategy"):
        checkpoint_kv_cache_scales(cfg, "m")
