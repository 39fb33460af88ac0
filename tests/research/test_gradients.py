"""Gradients with respect to named activations on the embedded SmolLM2-135M (float32), checked three ways:
central finite differences through our own forward pass, PyTorch autograd through transformers loading
the same GGUF (a zero perturbation added by forward hooks at the same sites), and attribution patching
against the dot product and the real patch computed in PyTorch.

The metric mixes the two kinds the API promises: a logit difference at each prompt's last position
(" Paris" - " Rome", " Mary" - " John") and a linear probe on a residual stream that is not among the
sites differentiated (so the captured activation must carry the upstream perturbations)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.initialization import no_init_weights  # noqa: E402

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.layers.linear import dequantize  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from jaxllm.models.fused_projections import split_columns  # noqa: E402
from jaxllm.models.llama import gate_up_group, layer_quant, qkv_group  # noqa: E402
from jaxllm.quantization.scheme import online_fp8  # noqa: E402
from jaxllm.research import (  # noqa: E402
    FunctionalModel,
    activation_gradients,
    attribution_patching,
    functional_model,
    run_model,
)

LAYER = 3
PROBE_LAYER = 10
SITES = (f"residual.{LAYER}", f"attn_out.{LAYER}", f"mlp_out.{LAYER}", "final_norm", "logits")
CLEAN = ["The capital of France is", "When Mary and John went to the store, John gave a drink to"]
CORRUPT = ["The capital of Italy is", "When Mary and John went to the store, Mary gave a drink to"]
ANSWERS = [(" Paris", " Rome"), (" Mary", " John")]


@pytest.fixture(scope="module")
def setup():
    loaded = load_model(ModelSpec())
    tok = loaded.tokenizer
    clean = [tok(p)["input_ids"] for p in CLEAN]
    corrupt = [tok(p)["input_ids"] for p in CORRUPT]
    assert [len(p) for p in clean] == [len(p) for p in corrupt] and len(clean[0]) != len(clean[1])
    ids = [[tok.encode(w, add_special_tokens=False) for w in pair] for pair in ANSWERS]
    assert all(len(t) == 1 for pair in ids for t in pair)
    good = np.array([pair[0][0] for pair in ids])
    bad = np.array([pair[1][0] for pair in ids])
    probe = np.random.default_rng(0).standard_normal(loaded.arch.hidden_size).astype(np.float32) / 20

    def metric(acts):  # logit difference at the last position + a probe on every real position
        last = acts.last("logits")  # f32[N, V]
        rows = np.arange(len(acts.lengths))
        probed = jnp.sum((acts[f"residual.{PROBE_LAYER}"] @ probe) * acts.mask)
        return jnp.sum(last[rows, good] - last[rows, bad]) + probed

    fm = functional_model(loaded)
    grads = activation_gradients(fm, clean, metric, SITES)
    return dict(
        fm=fm, clean=clean, corrupt=corrupt, metric=metric, good=good, bad=bad, probe=probe, grads=grads
    )


@pytest.fixture(scope="module")
def hf(setup):
    """transformers' Llama with the embedded model's weights as our loader holds them, dequantized to
    float32 (transformers' own GGUF reader gives the same model, tests/loader/test_embedded_gguf.py, but
    parses the file for about 20 s on a 2-core machine)."""
    fm = setup["fm"]
    a, params = fm.arch, fm.params
    assert a.tie_word_embeddings and a.hidden_act == "silu" and not a.attention_bias
    config = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=True,
    )  # fmt: skip
    with no_init_weights():  # every weight is loaded below; random init would cost seconds
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def weight(tree, proj, i):  # f32[in, out]
        scheme = layer_quant(a, i).get(proj)
        return dequantize(tree[proj], scheme, jnp.float32) if scheme else tree[proj]["kernel"]

    state = {
        "model.embed_tokens.weight": params["embed_tokens"]["embedding"],
        "model.norm.weight": params["norm"]["scale"],
    }
    for i in range(a.num_layers):
        t, pre = params[f"layers_{i}"], f"model.layers.{i}."
        q, k, v = split_columns(qkv_group(a), weight(t["attn"], "qkv_proj", i))
        gate, up = split_columns(gate_up_group(a), weight(t["mlp"], "gate_up_proj", i))
        state |= {
            pre + "input_layernorm.weight": t["input_norm"]["scale"],
            pre + "post_attention_layernorm.weight": t["post_attn_norm"]["scale"],
            pre + "self_attn.q_proj.weight": q.T,
            pre + "self_attn.k_proj.weight": k.T,
            pre + "self_attn.v_proj.weight": v.T,
            pre + "self_attn.o_proj.weight": weight(t["attn"], "o_proj", i).T,
            pre + "mlp.gate_proj.weight": gate.T,
            pre + "mlp.up_proj.weight": up.T,
            pre + "mlp.down_proj.weight": weight(t["mlp"], "down_proj", i).T,
        }
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}, strict=False, assign=True
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval().requires_grad_(False)  # autograd for the perturbations only


def torch_run(model, ids, setup, patch=None):
    """One prompt through transformers with a zero perturbation (requires_grad) added at every site by
    forward hooks; returns (metric, {site: perturbation}, {site: activation}). `patch`: (site, position,
    row) replaces that activation's row after the perturbation is added."""
    n = len(ids)
    layers = model.model.layers
    modules = {
        f"residual.{LAYER}": layers[LAYER],
        f"attn_out.{LAYER}": layers[LAYER].self_attn,
        f"mlp_out.{LAYER}": layers[LAYER].mlp,
        "final_norm": model.model.norm,
        f"residual.{PROBE_LAYER}": layers[PROBE_LAYER],
    }
    deltas = {
        s: torch.zeros(1, n, model.config.hidden_size, requires_grad=True) for s in SITES if s != "logits"
    }
    deltas["logits"] = torch.zeros(1, n, model.config.vocab_size, requires_grad=True)
    acts = {}

    def hook(site):
        def edit(module, args, out):
            x = out[0] if isinstance(out, tuple) else out
            if site in deltas:
                x = x + deltas[site]
            if patch is not None and patch[0] == site:
                x = x.clone()
                x[0, patch[1]] = torch.as_tensor(patch[2])
            acts[site] = x
            return (x, *out[1:]) if isinstance(out, tuple) else x

        return edit

    handles = [m.register_forward_hook(hook(s)) for s, m in modules.items()]
    try:
        logits = model(torch.tensor([ids])).logits + deltas["logits"]  # [1, n, V]
    finally:
        for h in handles:
            h.remove()
    acts["logits"] = logits
    return logits, deltas, acts


def torch_metric(logits, acts, setup, i):
    probe = torch.as_tensor(setup["probe"])
    return (
        logits[0, -1, setup["good"][i]]
        - logits[0, -1, setup["bad"][i]]
        + (acts[f"residual.{PROBE_LAYER}"][0] @ probe).sum()
    )


@pytest.fixture(scope="module")
def torch_reference(setup, hf):
    """PyTorch's metric, gradients and activations for the clean prompts, and activations for the corrupt."""
    value, grads, clean_acts, corrupt_acts = 0.0, [], [], []
    for i, ids in enumerate(setup["clean"]):
        logits, deltas, acts = torch_run(hf, ids, setup)
        m = torch_metric(logits, acts, setup, i)
        m.backward()
        value += float(m.detach())
        grads.append({s: d.grad[0].numpy() for s, d in deltas.items()})
        clean_acts.append({s: a[0].detach().numpy() for s, a in acts.items()})
    with torch.no_grad():
        for ids in setup["corrupt"]:
            _, _, acts = torch_run(hf, ids, setup)
            corrupt_acts.append({s: a[0].numpy() for s, a in acts.items()})
    return dict(value=value, grads=grads, clean=clean_acts, corrupt=corrupt_acts)


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


def test_gradients_match_central_finite_differences(setup):
    """Directional derivatives g . u against (f(x + e u) - f(x - e u)) / 2e at every site, along unit
    directions u = (g / |g| + r) / |...| with r a random unit direction over the prompts' real rows: a
    gradient at the wrong site, position or scale misses by O(|g|) there, while a purely random u
    (nearly orthogonal to g in d = N * L * H dimensions) would hide such errors in rounding.

    e is 3e-3 of the site's activation norm per token, and the bound is 1e-3 |g| (the largest derivative
    a unit direction can have). Float32 rounding of the O(10) metric is about 1e-5 per evaluation, which
    the difference divides by 2e (e is 0.04 to 5 here), and the truncation error (e^2 / 6 times the third
    derivative) is of the same order: measured errors stay near 1e-4 |g|, ten times inside the bound."""
    fm, clean, metric, g = setup["fm"], setup["clean"], setup["metric"], setup["grads"]
    rng = np.random.default_rng(1)
    mask = g.activations["logits"].any(-1)[..., None]  # bool[N, L, 1]: real positions
    zero = {s: np.zeros_like(g.gradients[s]) for s in SITES}
    read = ("logits", f"residual.{PROBE_LAYER}")

    def f(site, step):
        return float(metric(run_model(fm, clean, read, {**zero, site: step})))

    assert abs(f(SITES[0], zero[SITES[0]]) - g.value) < 1e-5 * abs(g.value)
    for site in SITES:
        grad = g.gradients[site]
        norm = np.linalg.norm(grad)
        eps = 3e-3 * np.linalg.norm(g.activations[site]) / np.sqrt(mask.sum())
        r = rng.standard_normal(grad.shape).astype(np.float32) * mask
        u = grad / norm + r / np.linalg.norm(r)
        u /= np.linalg.norm(u)
        fd = (f(site, eps * u) - f(site, -eps * u)) / (2 * eps)
        predicted = float(np.sum(grad * u))
        assert abs(predicted - fd) <= 1e-3 * norm, (site, predicted, fd)
        assert abs(fd) > 0.5 * norm, site  # u leans on g: a zero or misplaced gradient cannot pass


def test_gradients_and_activations_match_pytorch_autograd(setup, torch_reference):
    """Same weights in transformers, perturbation hooks at the same modules: metric, activations and
    gradients at every site, prompt by prompt (padding rows must be exactly zero).

    Bound 1e-4 relative (norm over each array): both sides compute in float32 from the same dequantized
    weights; the differences are summation order and the attention kernel, about 1e-6 per op over 30
    layers."""
    g, ref = setup["grads"], torch_reference
    assert abs(g.value - ref["value"]) <= 1e-4 * abs(ref["value"])
    for i, n in enumerate(g.lengths):
        for site in SITES:
            assert rel_err(g.activations[site][i, :n], ref["clean"][i][site]) <= 1e-4, site
            assert rel_err(g.gradients[site][i, :n], ref["grads"][i][site]) <= 1e-4, site
            assert not g.gradients[site][i, n:].any() and not g.activations[site][i, n:].any()
    # the sites are told apart: mlp_out and residual share a gradient but not an activation
    np.testing.assert_allclose(g.gradients[f"mlp_out.{LAYER}"], g.gradients[f"residual.{LAYER}"], rtol=1e-5)
    assert rel_err(g.activations[f"mlp_out.{LAYER}"], g.activations[f"residual.{LAYER}"]) > 0.5


def test_attribution_patching_matches_pytorch(setup, hf, torch_reference):
    """(1) Each estimate is grad(clean) . (corrupt - clean), recomputed from PyTorch's gradients and
    activations. (2) The metric is linear in final_norm (logits are a linear map of it), so there the
    estimate must equal the real change from patching the corrupt row into the clean run in PyTorch,
    position by position (sign convention: corrupt minus clean)."""
    fm, metric = setup["fm"], setup["metric"]
    result = attribution_patching(fm, setup["clean"], setup["corrupt"], metric, SITES)
    ref = torch_reference
    assert abs(result.clean_value - ref["value"]) <= 1e-4 * abs(ref["value"])
    for i, n in enumerate(result.lengths):
        for site in SITES:
            want = np.einsum(
                "ld,ld->l", ref["grads"][i][site], ref["corrupt"][i][site] - ref["clean"][i][site]
            )
            got = result.estimates[site][i, :n]
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max(), err_msg=site)
            assert not result.estimates[site][i, n:].any()
        assert np.abs(result.estimates[f"attn_out.{LAYER}"][i]).max() > 1e-3  # the prompts differ there

    # the real patch, at final_norm, for the last position (the only one the logit difference reads)
    # and one earlier position (where only the probe, upstream, could see it: the change is 0)
    site = "final_norm"
    for i, ids in enumerate(setup["clean"]):
        with torch.no_grad():
            base = torch_metric(*torch_run(hf, ids, setup)[::2], setup, i)
            for p in (len(ids) - 1, 1):
                row = ref["corrupt"][i][site][p]
                logits, _, acts = torch_run(hf, ids, setup, patch=(site, p, row))
                actual = float(torch_metric(logits, acts, setup, i) - base)
                est = float(result.estimates[site][i, p])
                assert abs(est - actual) <= 1e-3 * max(abs(actual), 1.0), (i, p, est, actual)
        assert abs(float(result.estimates[site][i, len(ids) - 1])) > 0.1


def test_functional_model_of_llm_and_engine(setup):
    """`jaxllm.LLM()` holds the LoadedModel at `llm_engine.loaded`: the same arrays, reference attention."""
    fm = setup["fm"]
    loaded = SimpleNamespace(module=fm.module.clone(attn_backend="pallas"), params=fm.params, arch=fm.arch)
    for model in (SimpleNamespace(llm_engine=SimpleNamespace(loaded=loaded)), SimpleNamespace(loaded=loaded)):
        got = functional_model(model)
        assert got.params is fm.params and got.module.attn_backend == "reference"
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        functional_model(SimpleNamespace(module=fm.module.clone(tp_size=2), params=fm.params, arch=fm.arch))
    with pytest.raises(TypeError, match="jaxllm.LLM"):
        functional_model(object())


def test_errors_name_the_field(setup):
    fm, clean, metric = setup["fm"], setup["clean"], setup["metric"]
    with pytest.raises(ValueError, match="residual.99"):
        activation_gradients(fm, clean, metric, ["residual.99"])
    with pytest.raises(ValueError, match="'resid.3'"):
        activation_gradients(fm, clean, metric, ["resid.3"])
    with pytest.raises(ValueError, match=r"corrupt_prompts\[1\]"):
        attribution_patching(fm, clean, [clean[0], clean[1][:-1]], metric, SITES)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        activation_gradients(fm, [[]], metric, SITES)
    w8a8 = FunctionalModel(
        fm.module, fm.params, dataclasses.replace(fm.arch, quant=online_fp8(), layer_quant=None)
    )
    with pytest.raises(ValueError, match="W8A8"):  # rounding the activations: zero gradients
        activation_gradients(w8a8, clean, metric, SITES)
    with pytest.raises(ValueError, match="scalar"):
        activation_gradients(fm, clean, lambda acts: acts.last("logits")[:, 0], ["logits"])
