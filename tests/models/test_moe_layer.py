"""The sparse MoE layer (jaxllm/layers/moe.py) against a dense per-expert reference: every token through
its top-k experts by a Python loop in numpy, float64. Routings are chosen so that experts get uneven
numbers of rows and one expert gets none; the Qwen3-MoE layer pattern is checked against transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.moe import moe_experts, route_top_k, sparse_moe
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.fused_projections import FusedGroup, FusedPart, fuse_columns

T, H, E, I, K = 9, 16, 5, 12, 2


def silu(x):
    return x / (1.0 + np.exp(-x))


def reference_moe(x, weights, ids, gate, up, down):
    """x [T, H]; weights, ids [T, K]; gate/up [E, H, I], down [E, I, H] (numpy): sum_k w * expert(x)."""
    out = np.zeros((x.shape[0], down.shape[-1]))
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t], strict=True):
            out[t] += w * ((silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return out


def reference_route(logits, k, renormalize):
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, -1)
    return (w / w.sum(-1, keepdims=True) if renormalize else w), ids


def weights_for(seed, shards=1):
    rng = np.random.default_rng(seed)
    gate, up = rng.normal(0, 0.3, (E, H, I)), rng.normal(0, 0.3, (E, H, I))
    down = rng.normal(0, 0.3, (E, I, H))
    group = FusedGroup("g", (FusedPart("gate", I, 1), FusedPart("up", I, 1)), shards)
    gate_up = np.asarray(fuse_columns(group, [gate, up]))
    return gate, up, down, gate_up


@pytest.mark.parametrize("shards", [1, 2])
def test_experts_match_per_token_loop_with_uneven_and_empty_groups(shards):
    gate, up, down, gate_up = weights_for(0, shards)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(T, H))
    # expert 0 takes most rows, expert 3 none, the others one or two (a token's K experts are distinct)
    ids = np.array([[0, 1], [0, 2], [4, 0], [0, 1], [2, 0], [0, 4], [1, 0], [0, 2], [4, 1]], np.int32)
    w = rng.uniform(0.1, 1.0, (T, K))
    counts = np.bincount(ids.ravel(), minlength=E)
    assert counts[3] == 0 and counts[0] == 8 and len(set(counts.tolist())) > 2
    got = moe_experts(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(ids),
        jnp.asarray(gate_up, jnp.float32), jnp.asarray(down, jnp.float32), jax.nn.silu, shards,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(got), reference_moe(x, w, ids, gate, up, down), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("shards", [1, 2])
def test_experts_on_the_pallas_grouped_gemm(shards, monkeypatch):
    """`kernel=True` (the GPU path: kernels/grouped_matmul.py, interpreted here) against the same per-token
    loop, at widths the kernel takes (multiples of 16); both grouped GEMMs go through the kernel."""
    import jaxllm.layers.moe as moe

    calls = []
    kernel = moe.pallas_grouped_matmul
    monkeypatch.setattr(moe, "pallas_grouped_matmul", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    h, i = 32, 16
    rng = np.random.default_rng(5)
    gate, up, down = (
        rng.normal(0, 0.3, (E, h, i)),
        rng.normal(0, 0.3, (E, h, i)),
        rng.normal(0, 0.3, (E, i, h)),
    )
    group = FusedGroup("g", (FusedPart("gate", i, 1), FusedPart("up", i, 1)), shards)
    gate_up = np.asarray(fuse_columns(group, [gate, up]))
    x = rng.normal(size=(T, h))
    ids = np.array([[0, 1], [0, 2], [4, 0], [0, 1], [2, 0], [0, 4], [1, 0], [0, 2], [4, 1]], np.int32)
    w = rng.uniform(0.1, 1.0, (T, K))
    got = moe_experts(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(ids),
        jnp.asarray(gate_up, jnp.float32), jnp.asarray(down, jnp.float32), jax.nn.silu, shards, kernel=True,
    )  # fmt: skip
    assert len(calls) == 2
    np.testing.assert_allclose(
        np.asarray(got), reference_moe(x, w, ids, gate, up, down), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_softmax_then_top_k(renormalize):
    logits = np.random.default_rng(2).normal(size=(T, E))
    w, ids = route_top_k(jnp.asarray(logits, jnp.float32), K, renormalize)
    ref_w, ref_ids = reference_route(logits, K, renormalize)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-6)
    assert np.allclose(np.asarray(w).sum(-1), 1.0) == renormalize


def test_sparse_moe_end_to_end_with_a_starved_expert():
    """Router columns push every token away from expert 2: it gets no rows, the layer still matches."""
    gate, up, down, gate_up = weights_for(3)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(T, H)) + 1.0  # every token has a positive component along (1, ..., 1)
    router = rng.normal(0, 0.5, (H, E))
    router[:, 2] = -1.0  # x . router[:, 2] = -sum(x): far below the other experts' logits
    logits = x @ router
    ref_w, ref_ids = reference_route(logits, K, renormalize=False)
    assert 2 not in ref_ids
    got = sparse_moe(
        jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), jnp.asarray(gate_up, jnp.float32),
        jnp.asarray(down, jnp.float32), top_k=K, renormalize=False, act=jax.nn.silu,
    )  # fmt: skip
    want = reference_moe(x, ref_w, ref_ids, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_qwen3_moe_layer_pattern_matches_transformers():
    """dense_mlp_layers: the layers transformers builds with a dense MLP (mlp_only_layers and
    decoder_sparse_step)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    for step, only in ((1, []), (2, []), (3, [1, 5]), (1, [0, 3])):
        kw = dict(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            decoder_sparse_step=step, mlp_only_layers=only,
        )  # fmt: skip
        config = transformers.Qwen3MoeConfig(**kw)
        layers = [m.Qwen3MoeDecoderLayer(config, i) for i in range(6)]
        dense = tuple(i for i, layer in enumerate(layers) if isinstance(layer.mlp, m.Qwen3MoeMLP))
        cfg = dict(config.to_dict(), architectures=["Qwen3MoeForCausalLM"])
        assert ModelArchConfig.from_hf(cfg).dense_mlp_layers == dense, (step, only)


def test_bad_moe_configs_name_the_field():
    base = dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelArchConfig.from_hf(dict(base, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelArchConfig.from_hf(dict(base, mlp_only_layers=[7]))
    with pytest.raises(ValueError, match="decoder_sparse_step=0"):
        ModelArchConfig.from_hf(dict(base, decoder_sparse_step=0))


def test_a_missing_expert_tensor_is_named(tmp_path):
    """The loader stacks one checkpoint tensor per expert; a checkpoint that lacks one says which."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file

    from jaxllm.config import ModelSpec
    from jaxllm.loader import load_model

    config = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers_0/mlp/experts/down_proj/kernel of experts \[1\]"):
        load_model(ModelSpec(model=str(tmp_path), dtype="float32"))
