"""The model is plain linen: activations can be captured (`capture_intermediates`) and edited
(`nn.intercept_methods`) from outside, and bfloat16 checkpoints run in bfloat16."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ModelSpec
from jaxllm.loader import load_model
from jaxllm.models.llama import LlamaMLP
from tests.models.paged_runner import PagedRunner
from tests.models.step_inputs import one_sequence


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec(model="tiny-llama", load_format="dummy", seed=1))


def test_capture_intermediates(tiny):
    ids, kv, md = one_sequence(tiny.arch)
    (hidden, _), state = tiny.module.apply({"params": tiny.params}, ids, kv, md, capture_intermediates=True)
    inter = state["intermediates"]
    mlp_out = inter["layers_1"]["mlp"]["__call__"][0]
    assert mlp_out.shape == (5, tiny.arch.hidden_size)
    np.testing.assert_allclose(inter["norm"]["__call__"][0], hidden)


def test_intercept_mlp_equals_zeroed_weights(tiny):
    ids, kv, md = one_sequence(tiny.arch)

    def zero_layer1_mlp(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, LlamaMLP) and context.module.path[-2] == "layers_1":
            return jnp.zeros_like(out)
        return out

    with nn.intercept_methods(zero_layer1_mlp):
        edited, _ = tiny.module.apply({"params": tiny.params}, ids, kv, md)
    params = jax.tree.map(lambda x: x, tiny.params)
    params["layers_1"]["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(
        params["layers_1"]["mlp"]["down_proj"]["kernel"]
    )
    expected, _ = tiny.module.apply({"params": params}, ids, kv, md)
    original, _ = tiny.module.apply({"params": tiny.params}, ids, kv, md)
    np.testing.assert_allclose(edited, expected, atol=1e-6)
    assert not np.allclose(edited, original, atol=1e-3)


def test_bfloat16_checkpoint_runs_in_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(ModelSpec(model=str(tmp_path)))  # dtype auto: the checkpoint's bfloat16
    assert loaded.dtype == jnp.bfloat16 and loaded.arch.dtype == "bfloat16"
    prompt = list(range(10, 30))
    ours = PagedRunner(loaded, max_len=32, prefill_tokens=32).prefill([prompt])[0]
    with torch.no_grad():
        ref = model.float()(torch.tensor([prompt])).logits[0].numpy()  # same bf16 weights, f32 compute
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=0.05)
