"""In-process checks of the parallel plumbing that need no devices: path rules, size checks, settings."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from jaxllm.config import ParallelConfig
from jaxllm.models.config import ModelArchConfig
from jaxllm.parallel import (
    kv_cache_heads,
    param_partition_spec,
    resolve_distributed,
    validate_tensor_parallel,
)
from jaxllm.parallel.mesh import build_mesh
from jaxllm.quantization.scheme import LayerQuant, QuantScheme


def llama_arch(
    heads: int = 8, kv_heads: int = 2, intermediate: int = 128, vocab: int = 384
) -> ModelArchConfig:
    return ModelArchConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 16 * heads,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 128,
        }
    )


@pytest.mark.parametrize(
    ("path", "shape", "n", "want"),
    [
        ("layers_0/attn/q_proj/kernel", (128, 128), 4, P(None, "tp")),
        ("layers_0/attn/q_proj/bias", (128,), 4, P("tp")),
        ("layers_0/attn/k_proj/kernel", (128, 32), 2, P(None, "tp")),  # 2 KV heads over 2
        ("layers_0/attn/v_proj/bias", (32,), 2, P("tp")),
        ("layers_0/attn/o_proj/kernel", (128, 128), 4, P("tp", None)),
        ("layers_0/attn/o_proj/bias", (128,), 4, P()),
        ("layers_0/mlp/gate_proj/kernel", (128, 128), 8, P(None, "tp")),
        ("layers_0/mlp/up_proj/kernel", (128, 128), 8, P(None, "tp")),
        # fused: laid out shard by shard, so always column-parallel (K/V heads as one slot per device)
        ("layers_0/attn/qkv_proj/kernel", (128, 256), 8, P(None, "tp")),
        ("layers_0/attn/qkv_proj/bias", (256,), 8, P("tp")),
        ("layers_0/mlp/gate_up_proj/kernel", (128, 256), 8, P(None, "tp")),
        ("layers_0/mlp/down_proj/kernel", (128, 128), 8, P("tp", None)),
        ("layers_0/mlp/fc1/kernel", (128, 128), 8, P(None, "tp")),
        ("layers_0/mlp/fc2/kernel", (128, 128), 8, P("tp", None)),
        ("embed_tokens/embedding", (384, 128), 8, P("tp", None)),
        ("lm_head/kernel", (128, 384), 8, P(None, "tp")),
        ("embed_tokens/embedding", (385, 128), 8, P()),  # vocab not divisible: replicated
        ("layers_0/input_norm/scale", (128,), 8, P()),
        ("layers_0/attn/q_norm/scale", (16,), 8, P()),
        ("embed_positions/embedding", (130, 128), 8, P()),
        ("layers_0/attn/q_proj/kernel", (128, 128), 1, P()),
        # quantized leaves (jaxllm/quantization/scheme.py) follow their layer's kernel along N / K
        ("layers_0/attn/qkv_proj/qweight", (64, 256), 4, P(None, "tp")),  # int4 u8[K/2, N]
        ("layers_0/attn/qkv_proj/scales", (4, 256), 4, P(None, "tp")),
        ("layers_0/attn/qkv_proj/zeros", (4, 256), 4, P(None, "tp")),
        ("layers_0/mlp/gate_up_proj/weight_scale", (256,), 4, P("tp")),
        ("layers_0/attn/qkv_proj/perm", (128,), 4, P()),
        ("layers_0/attn/qkv_proj/input_scale", (), 4, P()),
        ("layers_0/attn/o_proj/qweight", (64, 128), 4, P("tp", None)),
        ("layers_0/attn/o_proj/scales", (4, 128), 4, P("tp", None)),  # whole groups per device
        ("layers_0/mlp/down_proj/zeros", (8, 128), 4, P("tp", None)),
        ("layers_0/mlp/down_proj/scales", (1, 128), 4, P()),  # per channel: every shard needs all
        ("layers_0/mlp/down_proj/weight_scale", (128,), 4, P()),
        ("layers_0/mlp/down_proj/perm", (128,), 4, P()),
        ("layers_0/mlp/down_proj/input_scale", (), 4, P()),
    ],
)
def test_partition_rules(path, shape, n, want):
    assert param_partition_spec(path, len(shape), shape, llama_arch(), n) == want


@pytest.mark.parametrize(
    ("path", "shape", "want"),
    [
        ("layers_0/attn/qkv_proj/qweight", (256, 128), P("tp", None)),  # [N, K]: N is the first axis
        ("layers_0/mlp/gate_up_proj/qweight", (256, 128), P("tp", None)),
        ("layers_0/attn/o_proj/qweight", (128, 128), P(None, "tp")),  # row-parallel: K, the second
        ("layers_0/mlp/down_proj/qweight", (128, 128), P(None, "tp")),
        ("layers_0/mlp/fc2/qweight", (128, 128), P(None, "tp")),
        ("layers_0/mlp/gate_up_proj/weight_scale", (256,), P("tp")),
        ("layers_0/mlp/down_proj/weight_scale", (128,), P()),
        ("layers_0/attn/qkv_proj/input_scale", (), P()),
    ],
)
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_w8a8_qweight_is_split_along_its_own_axes(path, shape, want, kind):
    """A W8A8 qweight is held [N, K] (jaxllm/quantization/scheme.py): its split swaps axes against the
    [K, N] layouts, which the same paths keep under a weight-only scheme."""
    w8a8 = dataclasses.replace(llama_arch(), quant=QuantScheme(kind, kind, kind))
    assert param_partition_spec(path, len(shape), shape, w8a8, 4) == want
    weight_only = dataclasses.replace(llama_arch(), quant=QuantScheme(kind, kind))
    if path.endswith("qweight"):
        assert param_partition_spec(path, 2, shape, weight_only, 4) == P(*reversed(tuple(want)))
    assert param_partition_spec(path, len(shape), shape, w8a8, 1) == P()


def test_w8a8_follows_each_layer_scheme():
    """Per-layer schemes (arch.layer_quant) decide per projection: a W8A8 o_proj beside a weight-only
    qkv_proj in the same layer."""
    w8a8, weight_only = QuantScheme("fp8", "fp8", "fp8"), QuantScheme("t", "int8")
    lq = LayerQuant(weight_only, overrides=(("o_proj", w8a8),))
    arch = dataclasses.replace(llama_arch(), layer_quant=(lq,))
    assert param_partition_spec("layers_0/attn/o_proj/qweight", 2, (128, 128), arch, 4) == P(None, "tp")
    assert param_partition_spec("layers_0/attn/qkv_proj/qweight", 2, (128, 256), arch, 4) == P(None, "tp")


def test_separate_kv_projections_need_n_to_divide_their_heads():
    """Fewer KV heads than devices works only fused (one K/V slot per device); separate K/V projections
    are refused by name, not replicated."""
    with pytest.raises(ValueError, match="layers_0/attn/k_proj/kernel: 2 KV heads do not split over"):
        param_partition_spec("layers_0/attn/k_proj/kernel", 2, (128, 32), llama_arch(kv_heads=2), 4)


def test_row_parallel_groups_must_split_whole():
    """3 groups of input rows cannot go to 2 devices: refused by name rather than cut inside a group."""
    with pytest.raises(ValueError, match="layers_0/mlp/down_proj/scales: 3 quantization groups"):
        param_partition_spec("layers_0/mlp/down_proj/scales", 2, (3, 128), llama_arch(), 2)


def test_kv_cache_heads():
    assert [kv_cache_heads(llama_arch(kv_heads=2), n) for n in (1, 2, 4, 8)] == [2, 2, 4, 8]
    assert kv_cache_heads(llama_arch(kv_heads=8), 4) == 8


@pytest.mark.parametrize(
    ("arch", "n", "words"),
    [
        (llama_arch(heads=12, kv_heads=4), 5, ["tensor_parallel_size=5", "attention heads (12)"]),
        (llama_arch(heads=12, kv_heads=4), 6, ["tensor_parallel_size=6", "KV heads (4)"]),
        (llama_arch(intermediate=100), 8, ["tensor_parallel_size=8", "intermediate size (100)"]),
    ],
)
def test_bad_sizes(arch, n, words):
    with pytest.raises(ValueError) as e:
        validate_tensor_parallel(arch, n)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_good_sizes_pass():
    for n in (1, 2, 4, 8):
        validate_tensor_parallel(llama_arch(heads=8, kv_heads=2), n)


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 exceeds the \d+ cpu device"):
        build_mesh(64)
    assert build_mesh(1) is None


def test_distributed_settings_from_env(monkeypatch):
    monkeypatch.setenv("JAXLLM_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAXLLM_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXLLM_PROCESS_ID", "3")
    s = resolve_distributed(ParallelConfig())
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:1234", 4, 3)
    s = resolve_distributed(ParallelConfig(coordinator_address="h:1", num_processes=2, process_id=1))
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("h:1", 2, 1)  # config wins
    monkeypatch.delenv("JAXLLM_COORDINATOR_ADDRESS")
    with pytest.raises(ValueError, match="coordinator_address"):
        resolve_distributed(ParallelConfig())
    monkeypatch.setenv("JAXLLM_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAXLLM_NUM_PROCESSES='two'"):
        resolve_distributed(ParallelConfig())


def test_cli_flags_reach_the_config():
    from jaxllm.server.cli import parse_args

    args = parse_args(
        [
            "m",
            "--tensor-parallel-size",
            "4",
            "--coordinator-address",
            "h:9",
            "--num-processes",
            "2",
            "--process-id",
            "1",
        ]  # fmt: skip
    )
    p = args.engine.parallel_config()
    assert (p.tensor_parallel_size, p.coordinator_address, p.num_processes, p.process_id) == (4, "h:9", 2, 1)


def test_device_kv_budget_counts_one_shard(monkeypatch):
    """A device budget holds 1/N of each block when the cache is split over N devices."""
    import jax.numpy as jnp

    from jaxllm.runner import kv_cache as kvc

    geo = kvc.KVGeometry(num_layers=2, num_kv_heads=8, head_dim=16, block_size=16, dtype=jnp.float32)
    free = 100 * geo.bytes_per_block
    limit = 10 << 30
    monkeypatch.setattr(
        kvc,
        "device_memory_budget",
        lambda util: (limit, limit - free - kvc._SAFETY_BYTES - int(0.02 * limit)),
    )
    assert kvc.num_blocks_for_memory(geo, 0.9, 0, 10**6)[0] == 100
    assert kvc.num_blocks_for_memory(geo, 0.9, 0, 10**6, shards=4)[0] == 400
