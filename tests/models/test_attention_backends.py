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
