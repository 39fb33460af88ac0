"""Every supported family against transformers (CPU, float32): tiny random checkpoint saved as safetensors,
loaded with `load_model`, run through the paged KV cache. Logits of every prompt position must match to
1e-4, and 32 greedy tokens must equal `generate(do_sample=False)` token for token."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.config import ModelSpec  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from tests.models.paged_runner import PagedRunner  # noqa: E402

VOCAB = 300
NEW_TOKENS = 32
LLAMA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

CASES = {
    "llama_tied": ("LlamaConfig", dict(LLAMA, tie_word_embeddings=True)),
    "llama3_rope_untied": (
        "LlamaConfig",
        dict(
            LLAMA,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),  # fmt: skip
    "llama_linear_rope": ("LlamaConfig", dict(LLAMA, rope_scaling=dict(rope_type="linear", factor=2.0))),
    # dynamic NTK only acts past max_position_embeddings: 16 is shorter than prompt + decode
    "llama_dynamic_rope": (
        "LlamaConfig",
        dict(LLAMA, max_position_embeddings=16, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    ),
    "llama_yarn_rope": (
        "LlamaConfig",
        dict(LLAMA, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    ),
    "mistral_sliding_window": ("MistralConfig", dict(LLAMA, sliding_window=8, tie_word_embeddings=False)),
    "qwen2_bias_tied": ("Qwen2Config", dict(LLAMA, tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3_qk_norm": ("Qwen3Config", dict(LLAMA, head_dim=32, tie_word_embeddings=False)),
    # MoE: 4 or 6 experts, 2 per token; no eos (generate's min_new_tokens would hide an eos our greedy picks)
    "mixtral_moe": (
        "MixtralConfig",
        dict(LLAMA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, eos_token_id=None),
    ),
    "qwen3_moe_dense_layer": (
        "Qwen3MoeConfig",
        dict(
            LLAMA,
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            eos_token_id=None,
        ),
    ),  # fmt: skip
    "opt_pre_ln": (
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
        ),
    ),  # fmt: skip
    "opt_post_ln_proj": (
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
    ),  # fmt: skip
}


def make_hf_model(config_cls: str, kwargs: dict, seed: int = 0):
    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves some weights at zero/one: spread them so bugs show
        for name, p in model.named_parameters():
            if "norm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model


def prompts_for(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, size=n).tolist() for n in (5, 11, 17)]


def hf_reference(model, prompts):
    """(logits per prompt [L, V], greedy continuation per prompt), one prompt at a time."""
    logits, tokens = [], []
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([[5]]))  # resets dynamic-NTK's cached frequencies (it keeps state)
            logits.append(model(torch.tensor([p])).logits[0].float().numpy())
            model(torch.tensor([[5]]))
            out = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
            )  # fmt: skip
            tokens.append(out[0, len(p) :].tolist())
    return logits, tokens


def check_against_hf(folder: str, model, prompts) -> None:
    loaded = load_model(ModelSpec(model=folder, dtype="float32"))
    ref_logits, ref_tokens = hf_reference(model, prompts)
    runner = PagedRunner(loaded, max_len=64)
    for ours, ref in zip(runner.prefill(prompts), ref_logits, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    runner = PagedRunner(loaded, max_len=64, seed=1)
    assert runner.greedy(prompts, NEW_TOKENS) == ref_tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers(case, tmp_path):
    config_cls, kwargs = CASES[case]
    model = make_hf_model(config_cls, kwargs)
    model.save_pretrained(tmp_path, safe_serialization=True)
    check_against_hf(str(tmp_path), model, prompts_for())


def test_sharded_safetensors_folder(tmp_path):
    model = make_hf_model("LlamaConfig", dict(LLAMA, tie_word_embeddings=False), seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    index = json.load(open(os.path.join(tmp_path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    check_against_hf(str(tmp_path), model, prompts_for(1))
