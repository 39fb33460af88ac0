"""Captures and steering through the real engine (paged KV, continuous batching, chunked prefill) on the
embedded SmolLM2-135M in float32, against transformers loading the same GGUF file: captured residuals
equal output_hidden_states, attention and MLP outputs equal what forward hooks on transformers' modules
see, logits equal its logits, and a steer equals the same vector added by a PyTorch forward hook. A
request's neighbours in the batch are untouched, and a zero-scale steer changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm import SamplingParams  # noqa: E402
from jaxllm.research_params import Patch, ResearchParams, Scale, Steer  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Once upon a time",
]
NEW = 6
LAYERS = (0, 7, 28)
SITES = [f"{k}.{i}" for i in LAYERS for k in ("residual", "attn_out", "mlp_out")] + ["final_norm", "logits"]


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [tok(p)["input_ids"] for p in PROMPTS]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kw)


def hf_activations(hf, ids: list[int], edit=None, head=None) -> dict[str, np.ndarray]:
    """Every site of SITES over `ids` from transformers, with forward hooks reading the attention and MLP
    outputs. `edit` = (site, fn): the hook at that site returns fn(its output [T, H]); `head` = (layer,
    head index, factor): a pre-hook scales that head's slice of o_proj's input."""
    found, hooks = {}, []
    layers = hf.model.layers
    for i, layer in enumerate(layers):
        for name, module in (("attn_out", layer.self_attn), ("mlp_out", layer.mlp), ("residual", layer)):

            def hook(mod, args, out, site=f"{name}.{i}"):
                tensor = out[0] if isinstance(out, tuple) else out
                if edit is not None and edit[0] == site:
                    tensor = edit[1](tensor[0])[None]
                found[site] = tensor[0].detach().numpy().copy()
                if isinstance(out, tuple):
                    return (tensor, *out[1:])
                return tensor

            hooks.append(module.register_forward_hook(hook))
    if head is not None:
        layer_i, h, factor = head
        d = hf.config.hidden_size // hf.config.num_attention_heads

        def pre_hook(mod, args):
            x = args[0].clone()
            x[..., h * d : (h + 1) * d] *= factor
            return (x,)

        hooks.append(layers[layer_i].self_attn.o_proj.register_forward_pre_hook(pre_hook))
    try:
        with torch.no_grad():
            res = hf(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    found["final_norm"] = res.hidden_states[-1][0].numpy()
    found["logits"] = res.logits[0].numpy()
    return found


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def test_captures_equal_transformers_batched_and_chunked(llm, hf, prompts):
    """Two requests capture every site of SITES beside a free one and two that capture only the prompt or
    only the generated positions; the longer prompt is prefilled in chunks."""
    every = [
        greedy(research=ResearchParams(capture=SITES, capture_positions=which))
        for which in ("all", "prompt", "generated")
    ]
    params = [every[0], greedy(), every[0], every[1], every[2]]
    batch = [prompts[0], prompts[1], prompts[2], prompts[1], prompts[1]]
    outs = llm.generate(None, params, prompt_token_ids=batch, use_tqdm=False)
    assert len(prompts[0]) < 8 < len(prompts[1]) and outs[1].outputs[0].captures is None
    n = len(prompts[1])
    for k in (0, 2, 3, 4):
        out = outs[k].outputs[0]
        ids = batch[k] + out.token_ids[:-1]  # the last token never goes through the model
        caps = out.captures
        want = {0: range(len(ids)), 2: range(len(ids)), 3: range(n), 4: range(n, n + NEW - 1)}[k]
        assert caps.positions == list(want), k
        ref = hf_activations(hf, ids)
        for site in SITES:
            err = rel_err(np.asarray(caps.arrays[site], np.float32), ref[site][caps.positions])
            assert err <= 1e-4, (k, site, err)
    # transformers' hidden_states[i + 1] is layer i's output, what the hooks read as residual.i
    ids = prompts[0]
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    np.testing.assert_array_equal(hf_activations(hf, ids)["residual.7"], hs[8][0].numpy())


def test_steering_equals_a_forward_hook(llm, hf, prompts):
    rng = np.random.default_rng(0)
    vector = rng.standard_normal(llm.llm_engine.loaded.arch.hidden_size).astype(np.float32)
    for site, scale in (("residual.5", 2.0), ("mlp_out.10", 4.0), ("attn_out.2", 3.0)):
        research = ResearchParams(capture=SITES, steer=[Steer(site, vector, scale)])
        (out,) = llm.generate(None, greedy(research=research), prompt_token_ids=prompts[1:2], use_tqdm=False)
        o = out.outputs[0]
        ids = prompts[1] + o.token_ids[:-1]
        ref = hf_activations(hf, ids, edit=(site, lambda t, v=vector, k=scale: t + k * torch.tensor(v)))
        assert o.token_ids == [int(t) for t in np.argmax(ref["logits"][len(prompts[1]) - 1 :], axis=-1)]
        for name in ("logits", "residual.28", "mlp_out.28"):
            assert rel_err(o.captures.arrays[name], ref[name]) <= 1e-4, (site, name)
        # the check can fail: the steer moved the activations
        unsteered = hf_activations(hf, ids)
        assert rel_err(unsteered["residual.28"], ref["residual.28"]) > 1e-2, site


def test_scale_heads_and_patches_equal_forward_hooks(llm, hf, prompts):
    """Each intervention against the same edit made by a PyTorch hook: the MLP's output zeroed, one head's
    output scaled before o_proj, a residual replaced at one position (activation patching)."""
    rng = np.random.default_rng(1)
    hidden = llm.llm_engine.loaded.arch.hidden_size
    patch_vector = rng.standard_normal(hidden).astype(np.float32)

    def patched(t):
        t = t.clone()
        t[3] = torch.tensor(patch_vector)
        return t

    cases = [
        (dict(scale=[Scale("mlp_out.10", 0.0)]), dict(edit=("mlp_out.10", lambda t: t * 0.0))),
        (dict(scale=[Scale("residual.4", 0.5)]), dict(edit=("residual.4", lambda t: t * 0.5))),
        (dict(scale=[Scale("attn_out.2", 0.0, head=3)]), dict(head=(2, 3, 0.0))),
        (dict(scale=[Scale("attn_out.0", 3.0, head=1)]), dict(head=(0, 1, 3.0))),
        (dict(patch=[Patch("residual.6", 3, patch_vector)]), dict(edit=("residual.6", patched))),
    ]
    for ours, theirs in cases:
        research = ResearchParams(capture=SITES, **ours)
        (out,) = llm.generate(None, greedy(research=research), prompt_token_ids=prompts[1:2], use_tqdm=False)
        o = out.outputs[0]
        ids = prompts[1] + o.token_ids[:-1]
        ref = hf_activations(hf, ids, **theirs)
        assert o.token_ids == [int(t) for t in np.argmax(ref["logits"][len(prompts[1]) - 1 :], axis=-1)]
        for name in ("logits", "residual.28", "attn_out.7"):
            assert rel_err(o.captures.arrays[name], ref[name]) <= 1e-4, (ours, name)
        assert rel_err(hf_activations(hf, ids)["residual.28"], ref["residual.28"]) > 1e-3, ours


def test_neighbours_untouched_and_zero_scale_steer_changes_nothing(llm, prompts):
    vector = np.ones(llm.llm_engine.loaded.arch.hidden_size, np.float32)
    alone = llm.generate(None, [greedy()] * 3, prompt_token_ids=prompts, use_tqdm=False)
    steered = greedy(research=ResearchParams(capture=SITES, steer=[Steer("residual.3", vector, 8.0)]))
    zero = greedy(research=ResearchParams(capture=SITES, steer=[Steer("residual.3", vector, 0.0)]))
    mixed = llm.generate(None, [steered, greedy(), zero], prompt_token_ids=prompts, use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[2].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids  # the steer did something


def test_bad_research_fields_are_refused(llm, prompts):
    hidden = llm.llm_engine.loaded.arch.hidden_size
    cases = [
        (dict(capture=["residual.30"]), "layer 30"),
        (dict(capture=["resid.3"]), "capture"),
        (dict(capture=["residual.1", "residual.1"]), "twice"),
        (dict(capture_positions="end"), "capture_positions"),
        (dict(steer=[Steer("residual.1", np.ones(hidden + 1))]), "steer.vector"),
        (dict(steer=[{"site": "logits", "vector": [1.0]}]), "steer.site"),
        (dict(scale=[{"site": "mlp_out.1", "factor": 0.0, "head": 2}]), "scale.head"),
        (dict(scale=[Scale("attn_out.1", 0.0, head=99)]), "scale.head"),
        (dict(patch=[{"site": "residual.1", "position": -1, "vector": [1.0]}]), "patch.position"),
        (dict(patch=[Patch("residual.1", 0, np.ones(3))]), "patch.vector"),
    ]
    for kw, needle in cases:
        with pytest.raises(ValueError, match=needle):
            llm.generate(
                None, greedy(research=ResearchParams(**kw)), prompt_token_ids=prompts[:1], use_tqdm=False
            )
