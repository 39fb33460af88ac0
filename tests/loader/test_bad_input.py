"""User mistakes give one-line errors naming the file, tensor or field (never a trace from deep inside)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxllm.config import ModelSpec
from jaxllm.loader import load_model
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.registry import get_model_class
from jaxllm.tokenizer import apply_chat_template

TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
    "tie_word_embeddings": True, "torch_dtype": "float32",
}  # fmt: skip


def tiny_weights(h=32, i=64, v=64, kv=16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.v_proj.weight": (kv, h), "model.layers.0.self_attn.o_proj.weight": (h, h),
        "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
    }  # fmt: skip
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def make_folder(path, config=TINY, weights=None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tiny_weights() if weights is None else weights, os.path.join(path, "model.safetensors"))
    return str(path)


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_good_folder_loads(tmp_path):
    folder = make_folder(tmp_path, {**TINY, "eos_token_id": 2})
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    loaded = load_model(ModelSpec(model=folder))
    assert loaded.tokenizer is None and loaded.arch.num_layers == 1
    assert loaded.arch.eos_token_ids == (2, 7)


def test_unsupported_architecture_lists_supported(tmp_path):
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=make_folder(tmp_path, {**TINY, "architectures": ["GPT2LMHeadModel"]})))
    assert (
        "GPT2LMHeadModel" in one_line(e)
        and "LlamaForCausalLM" in str(e.value)
        and "OPTForCausalLM" in str(e.value)
    )
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("Nope")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(ModelSpec(model=str(tmp_path / "nowhere")))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ModelSpec(model=str(tmp_path)))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(TINY, f)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelSpec(model=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(ModelSpec(model=str(tmp_path / "missing.gguf")))


def test_corrupt_files(tmp_path):
    folder = make_folder(tmp_path / "a")
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=folder))
    assert "model.safetensors" in one_line(e)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=str(bad)))
    assert "bad.gguf" in one_line(e)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(ValueError, match="config.json"):
        load_model(ModelSpec(model=folder))


def test_wrong_shape_and_missing_tensor(tmp_path):
    w = tiny_weights()
    w["model.layers.0.mlp.up_proj.weight"] = np.zeros((60, 32), np.float32)
    with pytest.raises(ValueError) as e:
        load_model(ModelSpec(model=make_folder(tmp_path / "a", weights=w)))
    assert "model.layers.0.mlp.up_proj.weight" in one_line(e) and "(60, 32)" in str(e.value)
    w = tiny_weights()
    del w["model.norm.weight"]
    with pytest.raises(ValueError, match="missing weights for norm/scale"):
        load_model(ModelSpec(model=make_folder(tmp_path / "b", weights=w)))
    w = tiny_weights()
    w["model.layers.0.self_attn.rogue.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="rogue"):
        load_model(ModelSpec(model=make_folder(tmp_path / "c", weights=w)))


def test_unsupported_quant_type_and_gguf_architecture(tmp_path):
    import gguf

    from jaxllm.loader.gguf_loader import dequantize_tensor

    class Tensor:
        name, tensor_type, data = (
            "blk.0.ffn_up.weight",
            gguf.GGMLQuantizationType.Q8_1,
            np.zeros((1, 36), np.uint8),
        )

    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*Q8_1"):
        dequantize_tensor(Tensor, "x.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'mamba' is not supported"):
        load_model(ModelSpec(model=str(tmp_path / "m.gguf")))


def test_presets_need_dummy_and_bad_rope(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # "no-such-model" is a Hub id: looked up in the cache only
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model(ModelSpec(model="llama-3.1-8b"))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(ModelSpec(model="no-such-model"))
    with pytest.raises(ValueError, match="needs a preset"):
        load_model(ModelSpec(model="./no-such-model", load_format="dummy"))
    with pytest.raises(ValueError, match="rope_type='mrope'"):
        ModelArchConfig.from_hf({**TINY, "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="longrope' needs short_factor, long_factor"):
        ModelArchConfig.from_hf({**TINY, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="num_heads=3"):
        ModelArchConfig.from_hf({**TINY, "num_attention_heads": 3, "num_key_value_heads": 2})


def test_chat_template_missing():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(NoTemplate(), [{"role": "user", "content": "hi"}])
