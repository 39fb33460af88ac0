"""Gemma 3 (text) against transformers on tiny random configs (CPU, float32): a checkpoint saved as
safetensors, loaded with `load_model`, run through the paged KV cache. Prompts are longer than the
sliding window, so the sliding layers really mask; logits of every prompt position match to 1e-4 (whole
prompts in one step, and in two chunks), and 32 greedy tokens equal `generate(do_sample=False)`."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from jaxllm.models.config import ModelArchConfig  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402
from tests.models.test_hf_families import NEW_TOKENS, VOCAB, hf_reference, prompts_for  # noqa: E402

GEMMA3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=2,
    eos_token_id=1, pad_token_id=0, sliding_window=6, rope_theta=10_000.0, rope_local_base_freq=100.0,
    query_pre_attn_scalar=24,
)  # fmt: skip
CASES = {
    # the hub's form: every 2nd layer global (sliding_window_pattern), tied embeddings, no soft-caps
    "pattern_tied": dict(GEMMA3, sliding_window_pattern=2),
    # explicit layer_types, a logit soft-cap, untied head, linear rope scaling (global layers only); the
    # attention soft-cap is set but, as in transformers' Gemma 3, not applied
    "types_softcap_untied": dict(
        GEMMA3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        attn_logit_softcapping=3.0,
        final_logit_softcapping=2.0,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),  # fmt: skip
}


def make_gemma3(kwargs: dict, seed: int = 0):
    config = transformers.Gemma3TextConfig(**kwargs)
    config.architectures = ["Gemma3ForCausalLM"]
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # Gemma's norm weights start at zero (a factor 1): spread them so bugs show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_gemma3_matches_transformers(case, tmp_path):
    model = make_gemma3(CASES[case])
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(ModelSpec(model=str(tmp_path), dtype="float32"))
    assert loaded.arch.layer_types == tuple(model.config.layer_types)
    assert "sliding_attention" in loaded.arch.layer_types and "full_attention" in loaded.arch.layer_types
    prompts = prompts_for()
    assert max(map(len, prompts)) > 2 * CASES[case]["sliding_window"]
    ref_logits, ref_tokens = hf_reference(model, prompts)
    runner = PagedRunner(loaded, max_len=64)
    for ours, ref in zip(runner.prefill(prompts), ref_logits, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    # chunked prefill: the second chunk reads the first one's K/V from the pages, through the window
    runner = PagedRunner(loaded, max_len=64, seed=2)
    first = runner.extend([p[:4] for p in prompts])
    rest = runner.extend([p[4:] for p in prompts])
    for a, b, ref in zip(first, rest, ref_logits, strict=True):
        np.testing.assert_allclose(np.concatenate([a, b]), ref, atol=1e-4, rtol=0)
    runner = PagedRunner(loaded, max_len=64, seed=1)
    assert runner.greedy(prompts, NEW_TOKENS) == ref_tokens


def test_gemma3_window_matters():
    """The reference would agree with a model that ignored the window if the prompts fit in it: the
    sliding layers' masking must change the logits (so the test above checks it)."""
    model = make_gemma3(CASES["pattern_tied"])
    wide = make_gemma3(dict(CASES["pattern_tied"], sliding_window=64))
    wide.load_state_dict(model.state_dict())
    p = torch.tensor([prompts_for()[2]])
    with torch.no_grad():
        assert not torch.allclose(model(p).logits[0, -1], wide(p).logits[0, -1], atol=1e-3)


def test_gemma3_multimodal_config_refused():
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        ModelArchConfig.from_hf(cfg)


def test_gemma3_config_forms_agree():
    """The hub's config.json (rope_theta, rope_local_base_freq, sliding_window_pattern) and transformers
    5's (rope_parameters keyed by layer type, layer_types) give one architecture."""
    hub = dict(GEMMA3, architectures=["Gemma3ForCausalLM"], num_hidden_layers=6, sliding_window_pattern=3)
    new = transformers.Gemma3TextConfig(**{k: v for k, v in hub.items() if k != "architectures"})
    new.architectures = ["Gemma3ForCausalLM"]
    a, b = ModelArchConfig.from_hf(hub), ModelArchConfig.from_hf(new)
    assert a == b
    assert a.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (a.rope_theta, a.rope_local_theta, a.query_pre_attn_scalar) == (10_000.0, 100.0, 24.0)
