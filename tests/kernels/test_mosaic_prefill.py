"""prefill_paged_attention_mgpu (Mosaic GPU) against ref_ragged_paged_attention (plain jnp, f32 softmax).

On the CPU the kernel runs in Mosaic GPU interpret mode, which simulates the warpgroups, the TMA
copies and the mbarriers (and checks that every barrier phase is observed), with P V taken from
shared memory (pv_mode "smem": the interpreter models neither register wgmma operands nor run_state
accumulators). Lowering for the "cuda" platform is checked on the CPU too, for the compiled forms.
`--gpu` runs the grid compiled on the GPU, in both pv modes, plus the `gpu`-marked tests
(`pytest -m "gpu or not gpu" --gpu tests/kernels/test_mosaic_prefill.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.mosaic_prefill import (
    MgpuConfig,
    default_config,
    prefill_paged_attention_mgpu,
    unit_schedule,
)
from jaxllm.kernels.reference import ref_ragged_paged_attention
from tests.kernels.cases import assert_matches_reference, make_problem, rel_err

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
C = MgpuConfig

# (q_lens, kv_lens, q_tile_aligned, dtype, page_size, (hq, hkv), d, config or None). kv_len > q_len:
# context before the chunk. Lengths 3, 37, 300, 513, 1023 do not line up with pages or tiles.
# num_ctas below the unit count makes CTAs loop over several units (the persistent path).
CASES = [
    ([128, 256], [128, 256], True, jnp.bfloat16, 16, (4, 2), 64, None),
    ([128, 256], [300, 256], True, jnp.bfloat16, 16, (4, 1), 128, C(num_ctas=3)),
    ([3, 40], [3, 40], False, jnp.bfloat16, 16, (4, 4), 64, None),
    ([64], [513], False, jnp.float16, 32, (8, 2), 64, C(num_ctas=2)),
    ([1, 37, 1, 3], [1023, 37, 513, 40], False, jnp.bfloat16, 16, (6, 2), 64, C(num_ctas=5)),
    ([200, 130], [1000, 130], False, jnp.float16, 64, (4, 2), 128, C(block_kv=64, stages=3)),
    ([300], [700], False, jnp.bfloat16, 16, (2, 1), 64, C(schedule_barrier=False, num_ctas=1)),
    (
        [300, 200],
        [700, 200],
        False,
        jnp.bfloat16,
        8,
        (2, 2),
        64,
        C(q_buffers=1, longest_first=False, num_ctas=3),
    ),
    ([130, 70], [500, 70], False, jnp.bfloat16, 16, (2, 1), 256, C(block_kv=64, q_buffers=1, num_ctas=2)),
    ([256], [256], True, jnp.float16, 128, (2, 1), 64, C(block_kv=128, stages=4, q_buffers=1, num_ctas=2)),
    # Many one- or two-block units in one CTA, each with a page tail, warpgroups not in lockstep.
    (
        [3, 5, 7, 2],
        [131, 133, 7, 150],
        False,
        jnp.bfloat16,
        16,
        (2, 1),
        64,
        C(schedule_barrier=False, num_ctas=1),
    ),
]


def _id(c):
    q_lens, kv_lens, aligned, dt, ps, (hq, hkv), d, cfg = c
    name = (
        f"q{'-'.join(map(str, q_lens))}-kv{'-'.join(map(str, kv_lens))}-{'aligned' if aligned else 'padded'}"
    )
    name += f"-{jnp.dtype(dt).name}-ps{ps}-h{hq}x{hkv}-d{d}"
    if cfg is not None:
        fields = (
            "block_kv",
            "stages",
            "schedule_barrier",
            "longest_first",
            "persistent",
            "num_ctas",
            "q_buffers",
        )
        name += "-" + "-".join(f"{f}{getattr(cfg, f)}" for f in fields if getattr(cfg, f) != getattr(C(), f))
    return name


def _run(case, interpret, pv_mode=None, seed=0, interpret_params=None):
    q_lens, kv_lens, aligned, dtype, ps, (hq, hkv), d, cfg = case
    prob = make_problem(
        q_lens,
        kv_lens,
        hq=hq,
        hkv=hkv,
        d=d,
        page_size=ps,
        dtype=dtype,
        seed=seed,
        pad_rows=0 if aligned else 3,
    )
    if pv_mode is not None:
        cfg = dataclasses.replace(cfg or default_config(d), pv_mode=pv_mode)
    out = prefill_paged_attention_mgpu(
        *prob.args(),
        sm_scale=d**-0.5,
        q_tile_aligned=aligned,
        config=cfg,
        interpret=interpret_params if interpret_params is not None else interpret,
    )
    return prob, np.asarray(out, np.float32)


def _check(case, interpret, pv_mode=None):
    dtype, d = case[3], case[6]
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
    """Llama-3.1-8B heads (32 q / 8 kv, d 128), page 16: two 1024-token prompts and a chunk with context."""
    if not on_gpu:
        pytest.skip("needs --gpu")
    for case in (
        ([1024, 1024], [1024, 1024], True, jnp.bfloat16, 16, (32, 8), 128, None),
        ([512, 77], [2000, 77], False, jnp.bfloat16, 16, (32, 8), 128, None),
    ):
        _check(case, interpret=False)


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
    for case in (CASES[1], CASES[4]):
        _run(case, True, interpret_params=plgpu.InterpretGPUParams(detect_races=True))
        assert not mgpu_interpret.get_races().races_found, _id(case)


@pytest.mark.parametrize("num_units, grid", [(1, 1), (7, 3), (9, 3), (12, 5), (264, 132), (300, 132), (5, 8)])
def test_unit_schedule_covers_every_unit_once(num_units, grid):
    grid = min(grid, num_units)
    seen = []
    for pid in range(grid):
        count, unit_of = unit_schedule(jnp.int32(pid), num_units, grid)
        seen += [int(unit_of(jnp.int32(k))) for k in range(int(count))]
    assert sorted(seen) == list(range(num_units))


@pytest.mark.own_process
def test_detects_wrong_answer(interpret):
    """The check can fail: a wrong scale must be caught by the same tolerance."""
    prob = make_problem([130], [300], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.float16)
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=0.125)
    out = prefill_paged_attention_mgpu(*prob.args(), sm_scale=0.2, interpret=interpret)
    assert rel_err(out[: prob.num_rows], ref[: prob.num_rows]) > TOL[jnp.float16]


@pytest.mark.own_process
def test_padding_sequences_and_empty_batch(interpret):
    """num_seqs = 0: every row is padding and must come out as zeros."""
    prob = make_problem([1, 2], [5, 9], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    args = list(prob.args())
    args[6] = jnp.asarray([0], jnp.int32)
    out = np.asarray(prefill_paged_attention_mgpu(*args, sm_scale=0.125, interpret=interpret), np.float32)
    assert (out == 0).all()


def test_aligned_precondition_is_checked():
    prob = make_problem([100, 156], [100, 156], hq=2, hkv=1, d=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="q_tile_aligned"):
        prefill_paged_attention_mgpu(*prob.args(), sm_scale=0.125, q_tile_aligned=True, interpret=True)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of num kv heads"),
        (lambda a: {**a, **{n: a[n][..., :32] for n in ("q", "k_pages", "v_pages")}}, "head_dim"),
        (lambda a: {**a, "q": a["q"].astype(jnp.float32)}, "dtype"),
        (lambda a: {**a, "kv_lens": a["kv_lens"].astype(jnp.int16)}, "kv_lens"),
        (lambda a: {**a, "cu_q_lens": a["cu_q_lens"][:-1]}, "cu_q_lens"),
        (lambda a: {**a, "v_pages": a["v_pages"][:, :-1]}, "k_pages/v_pages"),
        (lambda a: {**a, "k_pages": a["k_pages"][:, :, :4], "v_pages": a["v_pages"][:, :, :4]}, "page_size"),
        (lambda a: {**a, "config": C(block_kv=256, stages=3)}, "shared memory"),
    ],
)
def test_rejects_bad_inputs(change, match):
    prob = make_problem([1, 2], [5, 9], hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16)
    names = ["q", "k_pages", "v_pages", "kv_lens", "block_tables", "cu_q_lens", "num_seqs"]
    kw = change(dict(zip(names, prob.args(), strict=True)))
    with pytest.raises(ValueError, match=match):
        prefill_paged_attention_mgpu(sm_scale=0.125, interpret=True, **kw)


@pytest.mark.parametrize(
    "kw", [{"block_q": 128}, {"block_kv": 96}, {"stages": 1}, {"pv_mode": "tmem"}, {"q_buffers": 3}]
)
def test_rejects_bad_config(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        MgpuConfig(**kw)


# (q_lens, kv_lens, aligned, dtype, (hq, hkv), d, page_size, config): the compiled forms.
LOWER = [
    ([2048] * 4, [2048] * 4, True, jnp.bfloat16, (32, 8), 128, 16, None),
    ([8192], [8192], True, jnp.bfloat16, (32, 8), 128, 16, C(block_kv=64, stages=3)),
    ([100, 900], [300, 900], False, jnp.float16, (32, 8), 128, 16, C(stages=3, q_buffers=1)),
    (
        [100, 900],
        [300, 900],
        False,
        jnp.bfloat16,
        (8, 2),
        64,
        32,
        C(schedule_barrier=False, persistent=False),
    ),
    ([100, 900], [300, 900], False, jnp.bfloat16, (8, 2), 256, 64, None),
    ([128], [128], True, jnp.bfloat16, (8, 2), 128, 8, C(pv_mode="smem")),
]


@pytest.mark.parametrize("case", LOWER, ids=lambda c: f"{len(c[0])}x{c[0][0]}-aligned{c[2]}-d{c[5]}-ps{c[6]}")
def test_lowers_for_cuda(case):
    """The Pallas -> Mosaic GPU lowering (layouts, TMA tiling, wgmma shapes) runs on the CPU."""
    q_lens, kv_lens, aligned, dtype, (hq, hkv), d, ps, cfg = case
    s = len(q_lens)
    b = max(-(-k // ps) for k in kv_lens)
    t = sum(q_lens)
    q = jax.ShapeDtypeStruct((t, hq, d), dtype)
    kv = jax.ShapeDtypeStruct((hkv, s * b + 1, ps, d), dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    f = lambda *a: prefill_paged_attention_mgpu(*a, sm_scale=d**-0.5, q_tile_aligned=aligned, config=cfg)
    traced = jax.jit(f).trace(q, kv, kv, i32(s), i32(s, b), i32(s + 1), i32(1))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
