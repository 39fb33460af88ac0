"""The attention layer's backend switch: each name reaches its kernel, and the configuration rejects
unknown names. The GPU kernels themselves are tested in tests/kernels; here they are stood in for by
their references (recording which one the layer called), since they do not compile on the CPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ATTENTION_BACKENDS
from jaxllm.engine_args import EngineArgs
from jaxllm.kernels import ops as gpu_ops
from jaxllm.kernels.kv_write_xla import ref_write_kv_cache
from jaxllm.kernels.reference import ref_ragged_paged_attention
from jaxllm.layers.attention import is_hopper, paged_attention, resolve_backend
from jaxllm.layers.attention_metadata import AttentionMetadata
from jaxllm.testing.kernel_cases import make_problem


def _layer_inputs():
    """A mixed batch (a decode row and a 5-row chunk) whose new K/V land in the last slots of each
    sequence, as the runner would place them."""
    q_lens, kv_lens, ps = [1, 5], [37, 5], 16
    prob = make_problem(q_lens, kv_lens, hq=4, hkv=2, d=64, page_size=ps, dtype=jnp.float32, pad_rows=0)
    bt = np.asarray(prob.md.block_tables)
    slots, positions = [], []
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for pos in range(kl - ql, kl):
            slots.append(bt[i, pos // ps] * ps + pos % ps)
            positions.append(pos)
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((len(slots), 2, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(slots), 2, 64)), jnp.float32)
    md = AttentionMetadata(
        positions=jnp.asarray(positions, jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=prob.md.block_tables,
        kv_lens=prob.md.kv_lens,
        cu_q_lens=prob.md.cu_q_lens,
        num_seqs=prob.md.num_seqs,
    )
    return prob.q, k, v, (prob.k_pages, prob.v_pages), md


@pytest.mark.parametrize(
    "backend, expected",
    [("pallas", "ragged_paged_attention"), ("pallas-hopper", "ragged_paged_attention_hopper")],
)
def test_backend_reaches_its_kernel(monkeypatch, backend, expected):
    called = []

    def stand_in(name):
        def op(*args, **kwargs):
            called.append(name)
            kwargs.pop("mosaic_min_q_len", None)
            return ref_ragged_paged_attention(*args, **kwargs)

        return op

    monkeypatch.setattr(gpu_ops, "write_kv_cache", ref_write_kv_cache)
    monkeypatch.setattr(gpu_ops, "ragged_paged_attention", stand_in("ragged_paged_attention"))
    monkeypatch.setattr(gpu_ops, "ragged_paged_attention_hopper", stand_in("ragged_paged_attention_hopper"))
    q, k, v, cache, md = _layer_inputs()
    out, (kp, vp) = paged_attention(q, k, v, cache, md, sm_scale=0.125, backend=backend)
    ref_out, (rkp, rvp) = paged_attention(q, k, v, cache, md, sm_scale=0.125, backend="reference")
    assert called == [expected]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    # The new K/V went into the cache at their slots (and nowhere else: the NaN-filled unused slots stay).
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(rkp))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(rvp))
    slots = np.asarray(md.slot_mapping)
    kp_flat = np.asarray(kp).reshape(2, -1, 64)
    np.testing.assert_array_equal(kp_flat[:, slots].transpose(1, 0, 2), np.asarray(k))


def test_config_names_the_backends():
    assert "pallas-hopper" in ATTENTION_BACKENDS
    assert EngineArgs(attention_backend="pallas-hopper").attention_backend == "pallas-hopper"
    with pytest.raises(ValueError, match="attention_backend='mosaic' .--attention-backend. must be one of"):
        EngineArgs(attention_backend="mosaic")
    assert resolve_backend("pallas-hopper") == "pallas-hopper"
    assert resolve_backend("auto") == "reference"  # no GPU here


@pytest.mark.parametrize(
    "cc, hopper", [("9.0", True), ("8.0", False), ("10.0", False), ("", False), (None, False)]
)
def test_auto_takes_the_hopper_kernels_only_on_sm90(cc, hopper):
    class Device:
        compute_capability = cc

    assert is_hopper(Device()) is hopper


@pytest.mark.parametrize(
    "backend, dtype, cc, ok",
    [
        ("pallas", jnp.float8_e4m3fn, "8.0", False),  # A100: Triton converts no e4m3 there
        ("pallas-hopper", jnp.float8_e4m3fn, "9.0", True),
        ("pallas", jnp.float8_e4m3fn, "8.9", True),  # Ada
        ("pallas", jnp.float8_e5m2, "8.0", True),
        ("pallas", jnp.bfloat16, "7.5", True),
        ("reference", jnp.float8_e4m3fn, "8.0", True),  # XLA converts on any device
        ("pallas", jnp.float8_e4m3fn, None, True),  # not reported: left to the compiler
    ],
)
def test_e4m3_pages_need_sm89_on_the_gpu_kernels(backend, dtype, cc, ok):
    from jaxllm.layers.attention import check_kv_cache_dtype

    class Device:
        compute_capability = cc

    if ok:
        check_kv_cache_dtype("fp8", dtype, backend, Device())
    else:
        with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' \(--kv-cache-dtype.*8\.0: use fp8_e5m2"):
            check_kv_cache_dtype("fp8", dtype, backend, Device())


@pytest.mark.parametrize("backend", ["pallas", "pallas-hopper"])
def test_fused_qkv_reads_in_place_like_separate_heads(monkeypatch, backend):
    """paged_attention_qkv on the GPU kernels (interpret mode here), which read q, k and v straight out of
    the fused [T, Hq + 2 Hkv, D] array: the same output and cache as the reference given them apart."""
    import functools

    from jaxllm.layers.attention import paged_attention_qkv

    interp = functools.partial
    monkeypatch.setattr(gpu_ops, "write_kv_cache", interp(gpu_ops.write_kv_cache_pallas, interpret=True))
    monkeypatch.setattr(
        gpu_ops, "ragged_paged_attention", interp(gpu_ops.ragged_paged_attention, interpret=True)
    )
    monkeypatch.setattr(
        gpu_ops, "ragged_paged_attention_hopper", interp(gpu_ops.ragged_paged_attention, interpret=True)
    )
    q, k, v, cache, md = _layer_inputs()
    qkv = jnp.concatenate([q, k, v], axis=1)
    ref_out, (rkp, rvp) = paged_attention(q, k, v, cache, md, sm_scale=0.125, backend="reference")
    out, (kp, vp) = paged_attention_qkv(
        qkv, (jnp.array(cache[0]), jnp.array(cache[1])), md, num_q_heads=q.shape[1], sm_scale=0.125,
        backend=backend,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(rkp))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(rvp))


def _interpret_gpu_ops(monkeypatch):
    """The GPU ops in interpret mode (the Hopper op is the real dispatcher: fp8 pages go to Triton)."""
    import functools

    interp = functools.partial
    monkeypatch.setattr(gpu_ops, "write_kv_cache", interp(gpu_ops.write_kv_cache_pallas, interpret=True))
    monkeypatch.setattr(
        gpu_ops, "ragged_paged_attention", interp(gpu_ops.ragged_paged_attention, interpret=True)
    )
    monkeypatch.setattr(
        gpu_ops,
        "ragged_paged_attention_hopper",
        interp(gpu_ops.ragged_paged_attention_hopper, interpret=True),
    )


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv"])
@pytest.mark.parametrize("backend", ["pallas", "pallas-hopper"])
def test_fp8_cache_same_bytes_and_output_on_every_backend(monkeypatch, backend, fused):
    """An fp8 cache (NaN in its unused slots) with scales given as f32[] arrays: the GPU backends write
    the same bytes as the reference layer and attend to the same output."""
    from jaxllm.layers.attention import paged_attention_qkv

    _interpret_gpu_ops(monkeypatch)
    q, k, v, (kp, vp), md = _layer_inputs()
    cache = (kp.astype(jnp.float8_e4m3fn), vp.astype(jnp.float8_e4m3fn))
    scales = dict(k_scale=jnp.float32(0.005), v_scale=jnp.float32(0.01))
    ref_out, (rkp, rvp) = paged_attention(q, k, v, cache, md, sm_scale=0.125, backend="reference", **scales)
    if fused:
        qkv = jnp.concatenate([q, k, v], axis=1)
        out, (okp, ovp) = paged_attention_qkv(
            qkv, (jnp.array(cache[0]), jnp.array(cache[1])), md, num_q_heads=q.shape[1], sm_scale=0.125,
            backend=backend, **scales,
        )  # fmt: skip
    else:
        fresh = (jnp.array(cache[0]), jnp.array(cache[1]))
        out, (okp, ovp) = paged_attention(q, k, v, fresh, md, sm_scale=0.125, backend=backend, **scales)
    assert okp.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(okp).view(np.uint8), np.asarray(rkp).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(ovp).view(np.uint8), np.asarray(rvp).view(np.uint8))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    # The reference itself: the new rows stored as k / k_scale, saturated (|k| past 2.24 exceeds 448).
    slots = np.asarray(md.slot_mapping)
    stored = np.asarray(rkp, np.float32).reshape(2, -1, 64)[:, slots].transpose(1, 0, 2)
    want = np.asarray(jnp.clip(k / 0.005, -448, 448).astype(jnp.float8_e4m3fn), np.float32)
    np.testing.assert_array_equal(stored, want)
    assert (np.abs(stored) == 448).any()


def test_kv_cache_scales_come_from_the_layer_params():
    """kv_cache_scales: a module's `k_scale` / `v_scale` params where present (a checkpoint's), else 1.0."""
    import flax.linen as nn

    from jaxllm.layers.attention import kv_cache_scales

    class Probe(nn.Module):
        @nn.compact
        def __call__(self):
            return kv_cache_scales(self)

    assert Probe().apply({"params": {}}) == (1.0, 1.0)
    got = Probe().apply({"params": {"k_scale": jnp.float32(0.5), "v_scale": jnp.float32(0.25)}})
    assert [float(x) for x in got] == [0.5, 0.25]


@pytest.mark.parametrize("model", ["llama", "opt"])
def test_checkpoint_scales_reach_the_cache_write(model):
    """A model whose layers carry k_scale / v_scale params stores k / k_scale in its fp8 pages: the stored
    values times the scale are the unscaled model's stored values (to fp8 rounding), and the logits agree."""
    import jax

    from jaxllm.models.config import ModelArchConfig
    from jaxllm.models.presets import get_preset
    from jaxllm.models.registry import build_model
    from tests.models.step_inputs import one_sequence
    from tests.models.test_layer_trace import OPT_CONFIG

    arch = ModelArchConfig.from_hf(get_preset("tiny-llama") if model == "llama" else OPT_CONFIG)
    module = build_model(arch)
    ids, kv, md = one_sequence(arch, 6)
    params = module.init(jax.random.key(0), ids, kv, md, method="init_all")["params"]
    fp8 = [(k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)) for k, v in kv]
    scaled = dict(params)
    for i in range(arch.num_layers):
        layer = dict(scaled[f"layers_{i}"])
        layer["attn"] = {**layer["attn"], "k_scale": jnp.float32(0.25), "v_scale": jnp.float32(0.125)}
        scaled[f"layers_{i}"] = layer

    def step(p):
        hidden, cache = module.apply({"params": p}, ids, fp8, md)
        return module.apply({"params": p}, hidden, method="compute_logits"), cache

    (l1, c1), (l2, c2) = jax.jit(step)(params), jax.jit(step)(scaled)
    for (k1, v1), (k2, v2) in zip(c1, c2, strict=True):
        k1, v1, k2, v2 = (np.asarray(x, np.float32)[:, 0, :4].ravel() for x in (k1, v1, k2, v2))
        assert not np.array_equal(k1, k2)  # the scale changed what was stored
        np.testing.assert_allclose(k2 * 0.25, k1, rtol=2**-3, atol=2**-8)
        np.testing.assert_allclose(v2 * 0.125, v1, rtol=2**-3, atol=2**-8)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=0.1, atol=0.1)
