"""Tensor parallelism on fake CPU devices: TP 1, 2, 4, 8 agree, parameters are split, bad sizes fail.

jax in the pytest process already runs with one device, so one subprocess with
`--xla_force_host_platform_device_count=8` runs every engine case (tests/parallel/tp_worker.py) and the
tests check its JSON. Models: tiny random Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norm), all 8 query heads
over 2 KV heads (TP 4 and 8 replicate KV heads), and OPT (8 heads, 8 KV heads: everything splits at 8).
The reference is TP = 1 on the same engine, which tests/models checks against transformers.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import assert_same_generation


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "opt"])
def test_tp_sizes_match_single_device(single_host, name):
    rows = single_host["cases"][name]
    ref = rows[0]
    assert ref["tp"] == 1
    assert all(len(t) == 6 for t in ref["tokens"])
    assert len({tuple(t) for t in ref["tokens"]}) > 1, "prompts should not all generate the same tokens"
    for row in rows[1:]:
        assert_same_generation(ref, row, f"{name} TP={row['tp']}")


SPLIT_ALWAYS = ("q_proj/", "qkv_proj/", "o_proj/kernel", "gate_up_proj/", "down_proj/kernel", "fc1/",
                "fc2/kernel", "embed_tokens/", "lm_head/")  # fmt: skip


def may_replicate(path: str) -> bool:
    """Norms, row-parallel biases, OPT's positions. (Llama's fused q|k|v holds one K/V slot per device
    where KV heads are fewer than devices, so even then nothing of it is replicated.)"""
    if "norm" in path or "embed_positions" in path:
        return True
    return path.endswith(("o_proj/bias", "down_proj/bias", "fc2/bias"))


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "opt"])
def test_parameters_are_split(single_host, name):
    for row in single_host["cases"][name]:
        n = row["tp"]
        per_device = row["param_bytes_per_device"]
        assert len(per_device) == n
        if n == 1:
            assert not row["replicated_params"]
            continue
        for path in row["replicated_params"]:
            assert may_replicate(path), f"{name} TP={n}: {path} is replicated"
        for path in SPLIT_ALWAYS:
            assert not any(path in p for p in row["replicated_params"])
        total, rep = row["param_bytes_total"], row["replicated_bytes"]
        # everything not replicated is split evenly: each device holds 1/N of it
        for dev, nbytes in per_device.items():
            assert nbytes == pytest.approx((total - rep) / n + rep, rel=0.01), (name, n, dev)
        share = max(per_device.values()) / (total / n)
        if name != "opt":
            assert abs(share - 1) < 0.05, f"{name} TP={n}: per-device bytes are {share:.3f} x total/N"
        # (OPT's learned position table [M + 2, H] is replicated: large next to this tiny model)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_fused_qkv_has_one_kv_slot_per_device_beyond_the_kv_heads(single_host, models, name):
    """q|k|v fused: Nq heads plus K and V with max(Hkv, N) slots each (a slot per device when N > Hkv)."""
    with open(os.path.join(models[name], "config.json")) as f:
        cfg = json.load(f)
    nq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nq
    for row in single_host["cases"][name]:
        slots = max(hkv, row["tp"])
        assert row["qkv_shape"] == [cfg["hidden_size"], (nq + 2 * slots) * d], (name, row["tp"])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_kv_cache_layout(single_host, name):
    for row in single_host["cases"][name]:
        n = row["tp"]
        heads = max(2, n)  # 2 KV heads, or one slot per device when N > 2
        assert row["kv_shape"][0] == heads
        assert row["kv_num_devices"] == n
        assert row["kv_shard_shape"][0] == heads // n
        assert row["kv_shard_shape"][1:] == row["kv_shape"][1:]


def test_fp8_kv_cache_splits_like_the_16_bit_one(single_host):
    """With kv_cache_dtype="fp8" every TP size holds float8 pages laid out as the 16-bit cache, and
    generates what TP 1 does: the quantized values are per element with per-layer scales, so splitting
    heads changes nothing but the partial sums' rounding (which may move an element to its neighbouring
    fp8 value: hence a looser logprob bound than the 16-bit cases')."""
    rows, ref16 = single_host["cases"]["llama-fp8"], single_host["cases"]["llama"]
    assert rows[0]["tp"] == 1
    for row in rows:
        n = row["tp"]
        assert row["kv_dtype"] == "float8_e4m3fn"
        assert row["kv_shape"][0] == max(2, n) and row["kv_shard_shape"][0] == max(2, n) // n
        assert row["kv_num_devices"] == n
    for row in rows[1:]:
        assert row["tokens"] == rows[0]["tokens"], f"fp8 TP={row['tp']}: greedy tokens differ from TP=1"
        for ref_seq, got_seq in zip(rows[0]["logprobs"], row["logprobs"], strict=True):
            for ref_step, got_step in zip(ref_seq, got_seq, strict=True):
                common = set(ref_step) & set(got_step)
                assert max(abs(ref_step[t] - got_step[t]) for t in common) < 0.05
    # The fp8 cache is not the 16-bit one: its logprobs moved (the comparison above could fail).
    moved = max(
        abs(a[t] - b[t])
        for sa, sb in zip(ref16[0]["logprobs"], rows[0]["logprobs"], strict=True)
        for a, b in zip(sa, sb, strict=True)
        for t in set(a) & set(b)
    )
    assert moved > 1e-4


def test_bad_sizes_are_clear_errors(single_host):
    errors = single_host["errors"]
    too_many = errors["llama"]["16"]
    assert too_many is not None and "tensor_parallel_size=16" in too_many and "8" in too_many
    heads = errors["odd"]["5"]
    assert heads is not None and "tensor_parallel_size=5" in heads and "12" in heads
    kv = errors["odd"]["6"]
    assert kv is not None and "tensor_parallel_size=6" in kv and "KV heads (4)" in kv
