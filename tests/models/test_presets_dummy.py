"""Random-weight presets: real shapes (parameter counts of the published models), dummy loading on device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelSpec
from jaxllm.loader import load_model
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.presets import PRESETS, get_preset
from jaxllm.models.registry import abstract_params, build_model
from tests.models.paged_runner import PagedRunner


@pytest.mark.parametrize("name,count", [("llama-3.1-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512)])
def test_preset_parameter_count(name, count):
    arch = ModelArchConfig.from_hf(get_preset(name))
    abstract = abstract_params(build_model(arch), jnp.bfloat16)
    assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(abstract)) == count
    assert abstract["layers_0"]["attn"]["qkv_proj"]["kernel"].shape == (
        arch.hidden_size,
        (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim,
    )
    assert abstract["layers_0"]["mlp"]["gate_up_proj"]["kernel"].shape == (
        arch.hidden_size,
        2 * arch.intermediate_size,
    )


@pytest.mark.parametrize("name", ["tiny-llama", "qwen2.5-7b", "opt"])
def test_abstract_params_equal_a_full_init(name):
    """abstract_params traces one layer and shares it; a full init of every layer is the reference."""
    from jaxllm.models.registry import dummy_inputs
    from tests.models.test_layer_trace import OPT_CONFIG

    module = build_model(ModelArchConfig.from_hf(OPT_CONFIG if name == "opt" else get_preset(name)))
    ids, caches, md = dummy_inputs(module.arch)
    full = jax.eval_shape(lambda: module.init(jax.random.key(0), ids, caches, md, method="init_all"))[
        "params"
    ]
    full = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float16), full)
    assert abstract_params(module, jnp.float16) == full


def test_qwen3_30b_a3b_preset_shape():
    """30,532,122,624 parameters (the published checkpoint's 61,064,245,248 bytes of bf16), experts stacked."""
    arch = ModelArchConfig.from_hf(get_preset("qwen3-30b-a3b"))
    abstract = abstract_params(build_model(arch), jnp.bfloat16)
    assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(abstract)) == 30_532_122_624
    mlp = abstract["layers_47"]["mlp"]
    assert mlp["experts"]["gate_up_proj"]["kernel"].shape == (128, 2048, 2 * 768)
    assert mlp["experts"]["down_proj"]["kernel"].shape == (128, 768, 2048)
    assert mlp["gate"]["kernel"].shape == (2048, 128) and arch.dense_mlp_layers == ()


def test_every_preset_parses():
    for name in PRESETS:
        arch = ModelArchConfig.from_hf(get_preset(name))
        assert arch.dtype in ("bfloat16", "float32")
    assert ModelArchConfig.from_hf(get_preset("llama-3.1-70b")).num_layers == 80


def test_dummy_tiny_runs():
    loaded = load_model(ModelSpec(model="tiny-llama", load_format="dummy", seed=3))
    assert loaded.tokenizer is None and loaded.model_name == "tiny-llama"
    p = loaded.params
    assert np.all(np.asarray(p["norm"]["scale"]) == 1.0)
    assert 0.01 < float(jnp.std(p["layers_1"]["mlp"]["gate_up_proj"]["kernel"])) < 0.03
    logits = PagedRunner(loaded, max_len=16, prefill_tokens=16).prefill([[1, 2, 3], [4, 5]])
    assert all(np.isfinite(lg).all() and lg.shape[1] == 512 for lg in logits)
