"""Phi-3 against transformers on tiny random configs (CPU, float32), through the paged KV cache: the
checkpoint holds q|k|v and gate|up each as one tensor, which the loader cuts into the parts it fuses in
its own layout; LongRoPE switches from the short to the long factors once a sequence passes
original_max_position_embeddings. transformers recomputes the whole context with the long factors when
a sequence crosses that length while decoding, where jaxllm (as vLLM) keeps the K/V it cached: the cases
stay on one side each (all short: prompts and decode within 64 of original 64, scale factor 2; all long:
every prompt past 16). Logits of every prompt position to 1e-4, 32 greedy tokens equal
`generate(do_sample=False)`."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.models.config import ModelArchConfig  # noqa: E402
from tests.models.test_hf_families import LLAMA, check_against_hf, make_hf_model, prompts_for  # noqa: E402

HALF = 8  # head_dim 16 / 2: the rotary frequencies
rng = np.random.default_rng(0)
LONGROPE = dict(
    rope_type="longrope",
    short_factor=(1.0 + rng.random(HALF)).round(3).tolist(),
    long_factor=(1.0 + 4 * rng.random(HALF)).round(3).tolist(),
)
# eos None: HF's min_new_tokens hides EOS from its argmax, which the paged greedy loop does not
PHI3 = dict(
    LLAMA, max_position_embeddings=64, original_max_position_embeddings=16, pad_token_id=0, eos_token_id=None
)
LONG_PROMPTS = [np.random.default_rng(1).integers(4, 300, size=n).tolist() for n in (17, 20, 25)]
CASES = {  # (config, prompts)
    "longrope_long_tied": (dict(PHI3, rope_scaling=LONGROPE, tie_word_embeddings=True), LONG_PROMPTS),
    "longrope_short": (
        dict(PHI3, max_position_embeddings=128, original_max_position_embeddings=64, rope_scaling=LONGROPE),
        prompts_for(),
    ),
    "default_rope_sliding": (dict(PHI3, sliding_window=8, tie_word_embeddings=False), prompts_for()),
    # Phi-4-mini's form: rotary on the first half of each head only (4 frequencies), LongRoPE, tied
    "partial_rotary_longrope": (
        dict(
            PHI3,
            partial_rotary_factor=0.5,
            tie_word_embeddings=True,
            rope_scaling=dict(
                LONGROPE, short_factor=LONGROPE["short_factor"][:4], long_factor=LONGROPE["long_factor"][:4]
            ),
        ),
        LONG_PROMPTS,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_phi3_matches_transformers(case, tmp_path):
    config, prompts = CASES[case]
    model = make_hf_model("Phi3Config", copy.deepcopy(config))  # transformers fills rope dicts in place
    model.save_pretrained(tmp_path, safe_serialization=True)
    names = set(model.state_dict())
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in names
        and "model.layers.0.mlp.gate_up_proj.weight" in names
    )
    check_against_hf(str(tmp_path), model, prompts)


def test_phi3_su_is_longrope():
    cfg = dict(PHI3, architectures=["Phi3ForCausalLM"], rope_scaling=dict(LONGROPE, type="su"))
    del cfg["rope_scaling"]["rope_type"]
    rope = ModelArchConfig.from_hf(cfg).rope
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 16


def test_partial_rotary_with_dynamic_ntk_refused():
    cfg = dict(PHI3, architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.75)
    cfg["rope_scaling"] = dict(rope_type="dynamic", factor=2.0)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelArchConfig.from_hf(cfg)


def test_partial_rotary_reaches_both_sides():
    """The partial case above checks something: transformers rotates 4 of 8 frequency pairs, and so do we."""
    config, _ = CASES["partial_rotary_longrope"]
    model = make_hf_model("Phi3Config", copy.deepcopy(config))
    assert model.model.rotary_emb.inv_freq.shape == (4,)
    cfg = model.config.to_dict()
    cfg["architectures"] = ["Phi3ForCausalLM"]
    assert ModelArchConfig.from_hf(cfg).rope["partial_rotary_factor"] == 0.5
