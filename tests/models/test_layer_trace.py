"""models/layer_trace.py: the layers of a step share one trace, and the step is the same program.

The reference is the plain loop (`trace_layers_once=False`): the lowered StableHLO must be the same
text and the outputs the same bits, while the layer's Python (here: its attention call) runs once per
step shape instead of once per layer. OPT is built from a Llama-shaped HF config of its own."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jaxllm.models.llama as llama
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.presets import get_preset
from jaxllm.models.registry import build_model
from tests.models.step_inputs import one_sequence

OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "ffn_dim": 64,
    "max_position_embeddings": 64,
    "do_layer_norm_before": True,
    "word_embed_proj_dim": 32,
    "activation_function": "relu",
}


def _model_and_params(arch_config, once):
    arch = ModelArchConfig.from_hf(arch_config)
    module = dataclasses.replace(build_model(arch), trace_layers_once=once)
    ids, kv, md = one_sequence(arch, 6)
    params = module.init(jax.random.key(0), ids, kv, md, method="init_all")["params"]
    return module, params, (ids, kv, md)


def _step(module):
    def step(params, ids, kv, md):
        hidden, kv = module.apply({"params": params}, ids, kv, md)
        return module.apply({"params": params}, hidden, method="compute_logits"), kv

    return jax.jit(step)


@pytest.mark.parametrize("config", [get_preset("tiny-llama"), OPT_CONFIG], ids=["llama", "opt"])
def test_same_program_and_same_bits(config):
    texts, outs = [], []
    for once in (False, True):
        module, params, args = _model_and_params(config, once)
        step = _step(module)
        texts.append(step.trace(params, *args).lower().as_text(debug_info=False))
        logits, kv = step(params, *args)
        outs.append((np.asarray(logits), np.asarray(kv[-1][0])))
    assert texts[0] == texts[1]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("once, expected", [(True, 1), (False, None)])
def test_layer_code_is_traced_once_per_shape(monkeypatch, once, expected):
    calls = []
    real = llama.paged_attention_qkv

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "paged_attention_qkv", counting)
    jax.clear_caches()
    module, params, args = _model_and_params(get_preset("tiny-llama"), once)
    calls.clear()  # init runs every layer as itself
    step = _step(module)
    step.trace(params, *args)
    assert len(calls) == (expected or module.arch.num_layers)
    calls.clear()
    ids, kv, md = args
    step.trace(params, ids, kv, md)  # the same shapes again: the step's own jit cache
    step.trace(
        params,
        ids[:4],
        kv,
        dataclasses.replace(md, positions=md.positions[:4], slot_mapping=md.slot_mapping[:4]),
    )
    assert len(calls) == (expected or module.arch.num_layers)  # one more shape: traced once more
