"""w4a16_gemv (Pallas, Triton lowering; decode rows on the CUDA cores) against dequantize-then-matmul in
float32 (int4_reference.py): in interpret mode on the CPU, compiled on the GPU with `--gpu`, and its
Triton IR compiled for sm_90 on the CPU where the `triton` package is installed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxllm.compat import pipeline_named_triton_loops
from jaxllm.kernels.int4_reference import ref_w4a16_matmul
from jaxllm.kernels.w4a16_gemv import MAX_ROWS, default_gemv_config, resolve_gemv_config, w4a16_gemv
from tests.kernels.test_w4a16_matmul import LLAMA_SHAPES, TOLERANCE, make_weights, make_x, max_rel_err
from tests.kernels.triton_sm90 import assert_compiles_for_sm90, lower_for_h100

pipeline_named_triton_loops()  # the `pipeline` cases compiled on the GPU really pipelined, as the model runs them

# (dtype, M, (K, N), g, knobs): every dtype, M from 1 to MAX_ROWS, per-channel and grouped scales, split-K
# off, default and ragged (a split count that leaves uneven runs), tiles other than the default's.
CASES = [
    (jnp.bfloat16, 1, (576, 192), 64, {}),
    (jnp.bfloat16, 2, (1536, 576), 128, dict(split_k=5)),
    (jnp.float16, 4, (4096, 512), "K", dict(block_k=64)),
    (jnp.float16, 1, (576, 192), 32, dict(block_n=64, split_k=1)),
    (jnp.float32, 3, (1536, 576), 128, dict(split_k=1)),
    (jnp.float32, 1, (4096, 512), 32, dict(block_n=16, block_k=32, num_warps=2)),
]
# each step's loads issued a step ahead: the same cases (ragged and empty-free splits, one and many rows)
CASES += [(d, m, kn, g, {**knobs, "prefetch": True}) for d, m, kn, g, knobs in CASES[:6]]
CASES += [(d, m, kn, g, {**knobs, "pipeline": True}) for d, m, kn, g, knobs in CASES[:6]]


def check(dtype, m, shape, g, knobs, interpret, qweight_fn=None):
    k, n = shape
    g = k if g == "K" else g
    qweight, scales, zeros = make_weights(k, n, g, dtype)
    x = make_x(m, k, dtype)
    ref = ref_w4a16_matmul(x, qweight, scales, zeros)
    if qweight_fn is not None:
        qweight = qweight_fn(qweight)
    out = w4a16_gemv(x, qweight, scales, zeros, interpret=interpret, **knobs)
    assert out.shape == (m, n) and out.dtype == x.dtype
    return max_rel_err(out, ref)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}-m{c[1]}-{c[2]}-g{c[3]}-{c[4]}")
def test_matches_reference(case, interpret):
    err = check(*case, interpret=interpret)
    assert err < TOLERANCE[jnp.dtype(case[0]).name], f"max relative error {err:.3g}"


def test_detects_wrong_answer(interpret):
    """The check can fail: nibbles swapped (odd inputs first) miss the reference by far."""
    err = check(jnp.bfloat16, 2, (576, 192), 64, {}, interpret, qweight_fn=lambda q: (q >> 4) | (q << 4))
    assert err > 100 * TOLERANCE["bfloat16"]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{}, {"prefetch": True}, {"pipeline": True}], ids=str)
@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=lambda s: f"k{s[0]}-n{s[1]}")
def test_llama_shapes_on_gpu(shape, knobs, on_gpu):
    if not on_gpu:
        pytest.skip("needs --gpu")
    for m in range(1, MAX_ROWS + 1):
        err = check(jnp.bfloat16, m, shape, 128, knobs, interpret=False)
        assert err < TOLERANCE["bfloat16"], (m, err)


@pytest.mark.parametrize(
    "m, knobs, match",
    [
        (MAX_ROWS + 1, {}, "rows of x"),
        (1, dict(block_k=256), "divide the group size"),
        (1, dict(block_n=48), "power of two"),
        (1, dict(split_k=99), "split_k=99"),
        (1, dict(bm=16), "unknown tuning knobs"),
        (1, dict(prefetch=1), "prefetch=1"),
        (1, dict(pipeline="yes"), "pipeline='yes'"),
    ],
)
def test_rejects_bad_configs(m, knobs, match):
    with pytest.raises(ValueError, match=match):
        resolve_gemv_config(m, 4096, 512, 128, **knobs)


@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=str)
def test_default_config_fills_the_card(shape):
    """Split-K gives the Llama shapes at least ~4 programs an SM (132 SMs), every split with work."""
    k, n = shape
    cfg = default_gemv_config(1, k, n, 128)
    assert resolve_gemv_config(1, k, n, 128) == cfg
    assert (n // cfg["block_n"]) * cfg["split_k"] >= 4 * 132
    steps = k // cfg["block_k"]
    per = -(-steps // cfg["split_k"])
    assert (cfg["split_k"] - 1) * per < steps


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("m, k, n", [(1, 4096, 28672), (4, 14336, 4096)], ids=str)
def test_compiles_for_sm90_without_mma(m, k, n, pipeline, monkeypatch, tmp_path):
    """Its Triton IR compiles for sm_90 with no spills, and without the tensor cores; with `pipeline` (and
    the lowering hook the linear layer installs) its step loads become asynchronous copies, without it
    they do not (Triton pipelines a loop with no dot only when asked)."""
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), jnp.bfloat16), sds((k // 2, n), jnp.uint8), sds((k // 128, n), jnp.bfloat16))
    cfg = resolve_gemv_config(m, k, n, 128, pipeline=pipeline)
    lower = lambda: lower_for_h100(lambda *a: w4a16_gemv(*a, pipeline=pipeline), *args, args[2])  # noqa: E731
    assert_compiles_for_sm90(lower, cfg, monkeypatch, tmp_path, mma=False, async_copies=pipeline)
