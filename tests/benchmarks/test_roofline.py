"""Roofline math against hand-computed cases (a toy shape worked out on paper, and Llama-3.1-8B)."""

import pytest

from benchmarks import roofline
from benchmarks.roofline import (
    Hardware,
    ModelShape,
    decode_step_bytes,
    decode_step_seconds,
    offline_bound,
    prefill_flops,
    roofline_line,
    shape_for_model,
)

# 1 layer, hidden 2, MLP 3, 1 head of 2, vocab 5, untied, 1 byte per weight and per KV element.
# layer = q 4 + k 4 + v 4 + o 4 + MLP 18 + norms 4 = 38; embedding 10; LM head 10; final norm 2.
TOY = ModelShape(1, 2, 3, 1, 1, 2, 5, False, weight_bytes_per_param=1, kv_bytes_per_element=1)


def test_toy_counts():
    assert TOY.layer_params == 38
    assert TOY.num_params == 60
    assert TOY.matmul_params == 48  # layers + LM head; the embedding is only gathered
    assert TOY.decode_weight_bytes == 50  # + the final norm
    assert TOY.kv_bytes_per_token == 4  # K and V, 1 kv head x 2 dims x 1 byte
    assert TOY.attention_flops(9) == 4 * 2 * 9


def test_toy_offline_bound():
    # prompt 3 -> 3 outputs: prefill 2*48*3 + 4*2*(1+2+3) = 336 FLOP; 2 decode steps at contexts 4 and 5.
    assert prefill_flops(TOY, 3) == 336
    hw = Hardware("toy", bandwidth=10.0, matmul_flops=100.0)
    b = offline_bound(TOY, [3], [3], max_batch=1, hw=hw)
    assert b.decode_steps == 2
    assert b.decode_bytes == 2 * 50 + (4 + 5) * 4
    assert b.decode_flops == 2 * 48 * 2 + 8 * 9
    assert b.prefill_seconds == pytest.approx(3.36)
    assert b.decode_seconds == pytest.approx(13.6)  # bandwidth-bound: 136 B at 10 B/s
    assert b.seconds == pytest.approx(16.96)
    assert b.output_tok_s == pytest.approx(3 / 16.96)
    assert b.total_tok_s == pytest.approx(6 / 16.96)


def test_decode_is_compute_bound_when_flops_are_slow():
    b = offline_bound(TOY, [3], [3], max_batch=1, hw=Hardware("slow", bandwidth=1e9, matmul_flops=1.0))
    assert b.decode_seconds == pytest.approx(264.0)


def test_decode_steps_batch_and_sequence_limits():
    # 4 + 0 decode tokens: the batch of 8 alone would allow 1 step, but one request needs 4 in a row.
    assert offline_bound(TOY, [2, 2], [5, 1], max_batch=8).decode_steps == 4
    # 8 requests x 3 decode tokens in batches of 2: 12 steps.
    assert offline_bound(TOY, [2] * 8, [4] * 8, max_batch=2).decode_steps == 12
    assert offline_bound(TOY, [2], [1], max_batch=2).decode_steps == 0


def test_llama_8b():
    s = shape_for_model("llama-3.1-8b")
    assert s is not None
    assert s.num_params == 8_030_261_248
    assert s.weight_bytes == pytest.approx(16.06e9, rel=1e-3)
    assert s.weight_bytes / 4.3e12 >= 3.7e-3  # every weight once: >= 3.7 ms
    assert s.kv_bytes_per_token == 128 * 1024  # 32 layers x 8 kv heads x 128 x (K, V) x 2 bytes
    # One decode step of batch 1 reads all but the 0.5 G-parameter embedding table: 15.01 GB -> 3.49 ms.
    assert decode_step_bytes(s, [0]) == (8_030_261_248 - 128256 * 4096) * 2
    assert decode_step_seconds(s, [0]) == pytest.approx(3.4907e-3, rel=1e-3)
    # 64 sequences of 2048 context add 64 * 2048 * 128 KiB = 17.2 GB.
    assert decode_step_bytes(s, [2048] * 64) - decode_step_bytes(s, []) == 64 * 2048 * 131072
    # Prefill: about 15 GFLOP per token of matmuls (the DESIGN note's 16 counts the embedding too).
    assert 2 * s.matmul_params / 1e9 == pytest.approx(15.01, rel=1e-3)


def test_roofline_line_share():
    b = offline_bound(TOY, [3], [3], max_batch=1, hw=Hardware("toy", 10.0, 100.0))
    line = roofline_line(b, measured_seconds=33.92)
    assert "= 50% of the bound" in line and "toy" in line


def test_bad_inputs():
    with pytest.raises(ValueError, match="max_batch"):
        offline_bound(TOY, [1], [1], max_batch=0)
    with pytest.raises(ValueError, match="output_lens"):
        offline_bound(TOY, [1, 2], [1], max_batch=1)
    with pytest.raises(ValueError, match="bandwidth"):
        Hardware("x", 0.0, 1.0)


def test_hardware_follows_the_device_kind(monkeypatch):
    """auto: the peaks of the card JAX (or nvidia-smi) names; an unknown card or the CPU: none at all,
    never another card's; an explicit choice wins; a bad one fails naming the flag."""
    from benchmarks import roofline

    kinds = {
        "NVIDIA H100 80GB HBM3": roofline.H100,  # JAX's device_kind on an H100 SXM
        "NVIDIA H100": roofline.H100,
        "NVIDIA H200": roofline.H200,
        "nvidia h200  ": roofline.H200,
        "NVIDIA H100 PCIe": None,  # 2.0 TB/s, other clocks: not the SXM board's peaks
        "NVIDIA H100 NVL": None,
        "NVIDIA H200 NVL": None,
        "NVIDIA A100-SXM4-80GB": None,
        "NVIDIA GH100": None,
        "cpu": None,
        "": None,
    }
    for kind, want in kinds.items():
        assert roofline.hardware_for_kind(kind) is want, kind
        assert roofline.hardware_for_device("auto", kind) is want, kind
    assert roofline.hardware_for_device("h100", "cpu") is roofline.H100
    # auto without a kind asks JAX: on this machine, the CPU, which has no bound.
    assert roofline.jax_device_kind() == "cpu" and roofline.hardware_for_device("auto") is None
    monkeypatch.setattr(roofline, "jax_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert roofline.hardware_for_device() is roofline.H100 and roofline.kernel_hardware() is roofline.H100
    monkeypatch.setattr(roofline, "jax_device_kind", lambda: "NVIDIA L4")
    assert roofline.kernel_hardware() is roofline.H200  # the sweeps' fallback, named H200 in their rows
    with pytest.raises(ValueError, match="--hardware"):
        roofline.hardware_for_device("a100")
    assert "'cpu'" in roofline.no_bound_line("cpu") and "--hardware h100|h200" in roofline.no_bound_line(
        "cpu"
    )


def test_the_bound_is_the_cards():
    """Llama-3.1-8B, one decode step at batch 1: 15.01 GB at 3.35 TB/s (H100) or 4.3 TB/s (H200)."""
    s = shape_for_model("llama-3.1-8b")
    step_bytes = (8_030_261_248 - 128256 * 4096) * 2
    assert decode_step_seconds(s, [0], roofline.H100) == pytest.approx(step_bytes / 3.35e12)
    assert decode_step_seconds(s, [0], roofline.H200) == pytest.approx(step_bytes / 4.3e12)
    b = offline_bound(s, [512], [2], max_batch=1, hw=roofline.H100)
    assert b.hardware == "H100" and roofline_line(b, 1.0).startswith("roofline (H100)")


def test_a_cached_prefix_is_not_prefilled():
    # TOY, prompt 5 of which 3 cached: matmuls 2*48*2 = 192; pairs 15 - 6 = 9 -> attention 4*2*9 = 72.
    assert prefill_flops(TOY, 5, cached_len=3) == 264
    assert prefill_flops(TOY, 5, cached_len=0) == prefill_flops(TOY, 5) == 2 * 48 * 5 + 8 * 15
    with pytest.raises(ValueError, match="cached_len"):
        prefill_flops(TOY, 5, cached_len=6)
    hw = Hardware("toy", bandwidth=10.0, matmul_flops=100.0)
    plain = offline_bound(TOY, [5, 5], [2, 2], max_batch=2, hw=hw)
    cached = offline_bound(TOY, [5, 5], [2, 2], max_batch=2, hw=hw, cached_lens=[0, 3])
    assert plain.prefill_flops - cached.prefill_flops == prefill_flops(TOY, 5) - 264
    assert cached.decode_bytes == plain.decode_bytes  # decode still reads the whole context's KV
    with pytest.raises(ValueError, match="cached_lens"):
        offline_bound(TOY, [5, 5], [2, 2], max_batch=2, hw=hw, cached_lens=[0])


def test_moe_counts_all_experts_in_memory_and_the_active_ones_per_token():
    """Qwen3-30B-A3B: the model's own parameter tree is the reference (ModelShape leaves out the q/k
    norms, 2 x 128 per layer); a token multiplies attention, the router and 8 of the 128 experts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models.config import ModelArchConfig
    from jaxllm.models.presets import get_preset
    from jaxllm.models.registry import abstract_params, build_model

    arch = ModelArchConfig.from_hf(get_preset("qwen3-30b-a3b"))
    tree = abstract_params(build_model(arch), jnp.bfloat16)
    count = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(tree))
    shape = shape_for_model("qwen3-30b-a3b")
    assert shape.num_params + 48 * 2 * 128 == count
    experts = 3 * 2048 * 768  # one expert's gate, up and down
    embedding = 151936 * 2048
    assert shape.matmul_params + 48 * 2 * 128 == count - embedding - 2048 - 48 * (128 - 8) * experts
    assert shape.decode_weight_bytes == 2 * (shape.matmul_params + 2048)
