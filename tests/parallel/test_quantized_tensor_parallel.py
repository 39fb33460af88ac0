"""Quantized layers under tensor parallelism on fake CPU devices: TP 2 and 4 give TP 1's tokens, and each
quantized leaf is split as jaxllm/parallel/sharding.py's rules say.

Models (tests/parallel/conftest.py): one tiny Llama (8 query heads over 2 KV heads, hidden 128,
intermediate 256) as fp8 W8A8 quantized at load, AWQ int4 group 32, GPTQ int4 group 32 with act order
(a perm leaf) and compressed-tensors int8 W8A8. The reference is TP 1 on the same engine, which
tests/quantization/test_quantized_model.py checks against transformers.
"""

from __future__ import annotations

import pytest

from tests.parallel.conftest import assert_same_generation

CASES = ["fp8", "awq", "gptq", "w8a8"]
W8A8 = ("fp8", "w8a8")  # qweight [N, K]
COLUMN = ("attn/qkv_proj", "mlp/gate_up_proj")  # output N split
ROW = ("attn/o_proj", "mlp/down_proj")  # input K split


@pytest.mark.parametrize("name", CASES)
def test_quantized_tp_sizes_match_single_device(quantized_host, name):
    rows = quantized_host["cases"][name]
    ref = rows[0]
    assert ref["tp"] == 1
    assert len({tuple(t) for t in ref["tokens"]}) > 1, "prompts should not all generate the same tokens"
    for row in rows[1:]:
        assert_same_generation(ref, row, f"{name} TP={row['tp']}")


def expected_shard(name: str, module: str, leaf: str, shape: list[int], n: int) -> list[int]:
    """The rules, written out: column-parallel leaves split their last axis (N), row-parallel ones their
    first (K: the packed rows, whole groups of scales/zeros); per-channel scales of a row-parallel layer,
    the act-order perm and a static input scale are whole on every device. A W8A8 qweight is [N, K]: the
    other way round."""
    if leaf in ("perm", "input_scale"):
        return shape
    if leaf == "qweight" and name in W8A8:
        k_split = module in ROW
        return [shape[0], shape[1] // n] if k_split else [shape[0] // n, shape[1]]
    if module in COLUMN:
        return [*shape[:-1], shape[-1] // n]
    assert module in ROW, module
    if leaf == "weight_scale" or (leaf in ("scales", "zeros") and shape[0] == 1):
        return shape
    return [shape[0] // n, *shape[1:]]


LEAVES = {
    "fp8": {"qweight": "float8_e4m3fn", "weight_scale": "float32"},
    "w8a8": {"qweight": "int8", "weight_scale": "float32"},
    "awq": {"qweight": "uint8", "scales": "float32", "zeros": "float32"},
    "gptq": {"qweight": "uint8", "scales": "float32", "zeros": "float32", "perm": "int32"},
}


@pytest.mark.parametrize("name", CASES)
def test_quantized_leaves_are_split_by_the_rules(quantized_host, name):
    for row in quantized_host["cases"][name]:
        n = row["tp"]
        leaves = row["quantized_leaves"]
        for layer in ("layers_0", "layers_1"):
            for module in COLUMN + ROW:
                got = {
                    k.rsplit("/", 1)[1]: v for k, v in leaves.items() if k.startswith(f"{layer}/{module}/")
                }
                assert {k: v["dtype"] for k, v in got.items()} == LEAVES[name], (name, n, module)
                for leaf, info in got.items():
                    want = expected_shard(name, module, leaf, info["shape"], n)
                    assert info["shard"] == want, (name, n, f"{layer}/{module}/{leaf}", info)
        if n > 1:  # the check can fail: the large leaves really are split, along N and K
            n_axis, k_axis = (0, 1) if name in W8A8 else (-1, 0)
            qkv = leaves["layers_0/attn/qkv_proj/qweight"]
            assert qkv["shard"][n_axis] * n == qkv["shape"][n_axis]
            down = leaves["layers_0/mlp/down_proj/qweight"]
            assert down["shard"][k_axis] * n == down["shape"][k_axis]
