"""decode_paged_attention_mgpu (persistent Mosaic GPU decode kernel) against ref_ragged_paged_attention.

On the CPU the kernel runs in Mosaic GPU interpret mode (warpgroups, TMA copies and mbarriers simulated,
every barrier phase checked to be observed), with P V taken from shared memory (pv_mode "smem"). Lowering
for the "cuda" platform is checked on the CPU too. `--gpu` runs the grid compiled on the GPU in both pv
modes, plus the `gpu`-marked tests (`pytest -m "gpu or not gpu" --gpu tests/kernels/test_mosaic_decode.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.mosaic_decode import DecodeMgpuConfig, decode_paged_attention_mgpu, decode_rows
from jaxllm.kernels.reference import ref_ragged_paged_attention
from tests.kernels.cases import assert_matches_reference, make_problem, rel_err

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
C = DecodeMgpuConfig

# (q_lens, kv_lens, dtype, page_size, (hq, hkv), d, config). Lengths 1, 3, 37, 129, 513, 1023 do not line
# up with pages or blocks; a few num_ctas make CTAs loop over many units (the ring runs across them).
CASES = [
    ([1, 1, 1, 1], [1, 3, 70, 130], jnp.bfloat16, 16, (4, 2), 64, C(num_ctas=3)),
    ([1, 37, 1, 3], [1023, 37, 513, 40], jnp.bfloat16, 16, (6, 2), 64, C(num_ctas=5)),  # chunks: causal rows
    ([1] * 5, [129, 1, 64, 65, 300], jnp.bfloat16, 16, (32, 8), 128, C(num_ctas=7, block_kv=128, stages=2)),
    ([1, 2], [200, 7], jnp.float16, 8, (16, 1), 64, C(num_ctas=1, stages=3)),  # 16 heads per KV head: R 16
    ([1, 1], [500, 77], jnp.bfloat16, 32, (4, 4), 256, C(stages=2)),  # MHA, head_dim 256
]


def _id(c):
    q_lens, kv_lens, dt, ps, (hq, hkv), d, cfg = c
    return (
        f"q{'-'.join(map(str, q_lens))}-kv{'-'.join(map(str, kv_lens))}-{jnp.dtype(dt).name}-ps{ps}"
        f"-h{hq}x{hkv}-d{d}-bkv{cfg.block_kv}-st{cfg.stages}-ctas{cfg.num_ctas}"
    )


def _run(case, interpret, pv_mode=None, interpret_params=None):
    q_lens, kv_lens, dtype, ps, (hq, hkv), d, cfg = case
    prob = make_problem(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=dtype)
    if pv_mode is not None:
        cfg = dataclasses.replace(cfg, pv_mode=pv_mode)
    out = decode_paged_attention_mgpu(
        *prob.args(),
        sm_scale=d**-0.5,
        config=cfg,
        interpret=interpret_params if interpret_params is not None else interpret,
    )
    return prob, np.asarray(out, np.float32)


def _check(case, interpret, pv_mode=None):
    dtype, d = case[2], case[5]
    prob, out = _run(case, interpret, pv_mode)
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=d**-0.5)
    assert_matches_reference(out, ref, prob, TOL[dtype])


@pytest.mark.own_process
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case, interpret):
    _check(case, interpret)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_smem_pv_matches_reference_on_gpu(case, on_gpu):
    """The compiled form of what interpret mode runs (P through shared memory)."""
    if not on_gpu:
        pytest.skip("needs --gpu")
    _check(case, interpret=False, pv_mode="smem")


@pytest.mark.gpu
def test_llama_shapes_on_gpu(on_gpu):
    """Llama-3.1-8B heads (32 q / 8 kv, d 128), page 16: a ragged decode batch on the default grid, and one
    with more units than CTAs in every config the benchmark sweeps."""
    if not on_gpu:
        pytest.skip("needs --gpu")
    lens = [1, 15, 16, 17, 640, 1023, 2048, 77] * 5
    for cfg in (C(), C(stages=6), C(block_kv=128, stages=3), C(stages=2, num_ctas=264), C(num_ctas=16)):
        _check(([1] * len(lens), lens, jnp.bfloat16, 16, (32, 8), 128, cfg), interpret=False)


@pytest.mark.own_process
def test_interpret_finds_no_races():
    """The happens-before race detector of interpret mode: barriers order every SMEM access."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret
    except ImportError:  # private module; its absence says nothing about the kernel
        pytest.skip("Mosaic GPU interpret internals not available")
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if jax.default_backend() != "cpu":
        pytest.skip("interpret mode runs on the CPU")
    case = ([1, 1, 2], [40, 131, 9], jnp.bfloat16, 16, (4, 2), 64, C(num_ctas=2, stages=2))
    _run(case, True, interpret_params=plgpu.InterpretGPUParams(detect_races=True))
    assert not mgpu_interpret.get_races().races_found


@pytest.mark.own_process
def test_detects_wrong_answer(interpret):
    """The check can fail: a wrong scale must be caught by the same tolerance."""
    prob = make_problem([1, 1], [300, 45], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.float16)
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=0.125)
    out = decode_paged_attention_mgpu(*prob.args(), sm_scale=0.2, interpret=interpret)
    assert rel_err(out[: prob.num_rows], ref[: prob.num_rows]) > TOL[jnp.float16]


@pytest.mark.own_process
def test_empty_batch_is_zero(interpret):
    """num_seqs = 0: every row is padding and must come out as zeros."""
    prob = make_problem([1, 1], [5, 9], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    args = list(prob.args())
    args[6] = jnp.asarray([0], jnp.int32)
    out = np.asarray(decode_paged_attention_mgpu(*args, sm_scale=0.125, interpret=interpret), np.float32)
    assert (out == 0).all()


def test_decode_rows_by_hand():
    """Rows' block-table rows and visible keys: decode rows see their whole context, a 3-row chunk after
    10 tokens of context is causal (positions 10, 11, 12 see 11, 12, 13 keys), padding rows see none."""
    kv_lens = jnp.asarray([7, 13, 0], jnp.int32)
    cu = jnp.asarray([0, 1, 4, 4], jnp.int32)
    rows = np.asarray(decode_rows(kv_lens, cu, jnp.asarray([2], jnp.int32), 6))
    assert rows.tolist() == [[0, 1, 1, 1, 0, 0], [7, 11, 12, 13, 0, 0]]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of num kv heads"),
        (lambda a: {**a, "q": a["q"].astype(jnp.float32)}, "dtype"),
        (lambda a: {**a, "kv_lens": a["kv_lens"].astype(jnp.int16)}, "kv_lens"),
        (lambda a: {**a, "k_pages": a["k_pages"][:, :, :4], "v_pages": a["v_pages"][:, :, :4]}, "page_size"),
        (lambda a: {**a, "config": C(block_kv=256, stages=4)}, "shared memory"),
    ],
)
def test_rejects_bad_inputs(change, match):
    prob = make_problem([1, 2], [5, 9], hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16)
    names = ["q", "k_pages", "v_pages", "kv_lens", "block_tables", "cu_q_lens", "num_seqs"]
    kw = change(dict(zip(names, prob.args(), strict=True)))
    with pytest.raises(ValueError, match=match):
        decode_paged_attention_mgpu(sm_scale=0.125, interpret=True, **kw)


def test_rejects_too_many_heads_per_kv_head():
    prob = make_problem([1], [5], hq=128, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="query heads per KV head"):
        decode_paged_attention_mgpu(*prob.args(), sm_scale=0.125, interpret=True)


@pytest.mark.parametrize("kw", [{"block_kv": 96}, {"stages": 1}, {"pv_mode": "tmem"}, {"num_ctas": 0}])
def test_rejects_bad_config(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        DecodeMgpuConfig(**kw)


# (tokens, seq slots, table width, (hq, hkv), d, page_size, config): the compiled forms.
LOWER = [
    (256, 256, 64, (32, 8), 128, 16, None),
    (32, 32, 513, (32, 8), 128, 16, C(block_kv=128, stages=3)),
    (64, 64, 64, (16, 2), 256, 16, C(stages=2)),
    (8, 8, 64, (8, 8), 64, 8, C(pv_mode="smem")),
]


@pytest.mark.parametrize("case", LOWER, ids=lambda c: f"t{c[0]}-h{c[3][0]}x{c[3][1]}-d{c[4]}-ps{c[5]}")
def test_lowers_for_cuda(case):
    """The Pallas -> Mosaic GPU lowering (layouts, TMA tiling, wgmma shapes) runs on the CPU."""
    t, s, b, (hq, hkv), d, ps, cfg = case
    q = jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((hkv, s * 4 + 1, ps, d), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    f = lambda *a: decode_paged_attention_mgpu(*a, sm_scale=d**-0.5, config=cfg)
    traced = jax.jit(f).trace(q, kv, kv, i32(s), i32(s, b), i32(s + 1), i32(1))
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
