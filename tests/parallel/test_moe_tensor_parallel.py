"""Qwen3-MoE under tensor parallelism on fake CPU devices: TP 4 generates what TP 1 does, and every
expert's weights are split along its intermediate size (layers/moe.py) while the router is replicated.

One subprocess with 4 devices runs the engine cases (tests/parallel/tp_worker.py); the reference is TP 1
on the same engine, which tests/models/test_hf_families.py checks against transformers.
"""

from __future__ import annotations

import pytest

from tests.parallel.conftest import VOCAB, assert_same_generation, run_single_host

EXPERTS, MOE_I = 4, 32


def save_tiny_qwen3_moe(folder: str) -> str:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.3, bos_token_id=0, eos_token_id=1, num_experts=EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=MOE_I, norm_topk_prob=True, mlp_only_layers=[0],
    )  # fmt: skip
    torch.manual_seed(11)
    Qwen3MoeForCausalLM(cfg).to(torch.float32).eval().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def moe_host(tmp_path_factory) -> dict:
    folder = save_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tp_moe") / "qwen3moe"))
    return run_single_host({"cases": [{"name": "qwen3moe", "model": folder, "tp": [1, 4]}]}, 4)


def test_moe_tp_sizes_match_single_device(moe_host):
    rows = moe_host["cases"]["qwen3moe"]
    assert rows[0]["tp"] == 1
    assert len({tuple(t) for t in rows[0]["tokens"]}) > 1, "prompts should not all generate the same tokens"
    for row in rows[1:]:
        assert_same_generation(rows[0], row, f"qwen3moe TP={row['tp']}")


def test_experts_are_split_and_the_router_replicated(moe_host):
    for row in moe_host["cases"]["qwen3moe"][1:]:
        n, replicated = row["tp"], row["replicated_params"]
        assert any(p.endswith("layers_1/mlp/gate/kernel") for p in replicated)
        assert not any("experts" in p for p in replicated), replicated
        shards = row["expert_shards"]
        assert shards["layers_1/mlp/experts/gate_up_proj/kernel"] == [EXPERTS, 64, 2 * MOE_I // n]
        assert shards["layers_1/mlp/experts/down_proj/kernel"] == [EXPERTS, MOE_I // n, 64]
