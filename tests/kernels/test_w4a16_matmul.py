"""w4a16_matmul (Pallas, Triton lowering) against dequantize-then-matmul in float32 (int4_reference.py).

Default grid: cases that cover every value of every axis (dtype x M x (K, N) x group size x split-K) at
least once, in interpret mode on the CPU. `-m full_grid`: the product grid. `--gpu` runs both compiled
on the GPU, plus the Llama-3.1-8B shapes. On the CPU the Pallas -> Triton lowering for an H100 is checked
too, and, where the `triton` package is installed, its compilation to sm_90 machine code.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.int4_reference import (
    dequantize_int4,
    group_size_of,
    pack_int4,
    ref_w4a16_matmul,
    unpack_int4,
)
from jaxllm.kernels.w4a16_matmul import default_config, resolve_config, split_steps, w4a16_matmul
from tests.kernels.triton_sm90 import assert_compiles_for_sm90, lower_for_h100

# Largest |out - ref| / max|ref| allowed: the output's rounding to its dtype (half an ulp relative to the
# element, below that relative to the largest) plus float32 summation-order differences (for float32 a
# few 1e-6 at K = 4096: the kernel adds per group and per split, the reference in one dot).
TOLERANCE = {"bfloat16": 2**-8, "float16": 2**-10, "float32": 2e-5}

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
MS = [1, 3, 16, 37, 128]
SHAPES = [(576, 192), (1536, 576), (4096, 512)]  # (K, N): the embedded model's, a Llama-like K
GROUPS = [32, 64, 128, "K"]  # "K": one group per column (per channel)
SPLITS = [1, 4]  # split-K off / on (4 with a K-step count it does not divide leaves ragged runs)

# (dtype, M, (K, N), g, split_k); split_k None: default_config's choice.
SMALL = [
    (jnp.bfloat16, 1, (576, 192), "K", 1),
    (jnp.bfloat16, 3, (1536, 576), 128, 4),
    (jnp.bfloat16, 37, (4096, 512), 32, 1),
    (jnp.bfloat16, 128, (1536, 576), 64, None),
    (jnp.float16, 16, (576, 192), 32, 4),
    (jnp.float16, 1, (4096, 512), 128, None),
    (jnp.float16, 37, (1536, 576), "K", 4),
    (jnp.float32, 3, (576, 192), 64, 1),
    (jnp.float32, 128, (4096, 512), "K", 4),
    (jnp.float32, 16, (1536, 576), 32, None),
]
FULL = [  # g must divide K: 128 does not divide 576
    c for c in itertools.product(DTYPES, MS, SHAPES, GROUPS, SPLITS) if c[3] == "K" or c[2][0] % c[3] == 0
]

# Llama-3.1-8B's projections (K, N), GPU only.
LLAMA_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def make_weights(k: int, n: int, g: int, dtype, seed: int = 0):
    """Random codes, scales and float zeros in the canonical layout: (qweight, scales, zeros)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.5, (k // g, n)) * 0.02 * rng.choice([-1.0, 1.0], (k // g, n))
    zeros = rng.uniform(0.0, 15.0, (k // g, n))
    return jnp.asarray(pack_int4(q)), jnp.asarray(scales, dtype), jnp.asarray(zeros, dtype)


def make_x(m: int, k: int, dtype, seed: int = 1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


def max_rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def check(dtype, m, shape, g, split_k, interpret, seed=0, **kw):
    k, n = shape
    g = k if g == "K" else g
    qweight, scales, zeros = make_weights(k, n, g, dtype, seed)
    x = make_x(m, k, dtype, seed + 1)
    out = w4a16_matmul(x, qweight, scales, zeros, split_k=split_k, interpret=interpret, **kw)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref = ref_w4a16_matmul(x, qweight, scales, zeros)  # float32 math
    err = max_rel_err(out, ref)
    assert err < TOLERANCE[jnp.dtype(dtype).name], f"max relative error {err:.3g}"


def _id(case):
    dtype, m, (k, n), g, split_k = case
    return f"{jnp.dtype(dtype).name}-m{m}-k{k}-n{n}-g{g}-sk{split_k}"


@pytest.mark.parametrize("case", SMALL, ids=_id)
def test_matches_reference(case, interpret):
    check(*case, interpret=interpret)


@pytest.mark.full_grid
@pytest.mark.parametrize("case", FULL, ids=_id)
def test_matches_reference_full_grid(case, interpret):
    check(*case, interpret=interpret)


def test_small_grid_covers_every_value():
    for axis, values in enumerate([DTYPES, MS, SHAPES, GROUPS]):
        assert {c[axis] for c in SMALL} == set(values), axis
    assert {c[4] for c in SMALL} == {1, 4, None}


@pytest.mark.parametrize(
    "kw",
    [dict(block_n=16, block_k=32), dict(block_m=32, block_n=64, block_k=128), dict(block_k=512, split_k=3)],
    ids=str,
)
def test_tile_overrides_match_reference(kw, interpret):
    """Tiles other than the default's: a step of several groups (block_k > g), the smallest tiles, a block
    of rows larger than M."""
    check(jnp.bfloat16, 5, (1536, 576), 64, kw.pop("split_k", 1), interpret=interpret, **kw)


def test_detects_wrong_answer(interpret):
    """The check can fail: the codes packed with the nibbles swapped (odd rows first) miss the
    reference by far more than the tolerance."""
    k, n, g = 576, 192, 64
    qweight, scales, zeros = make_weights(k, n, g, jnp.bfloat16)
    swapped = (qweight >> 4) | (qweight << 4)
    x = make_x(3, k, jnp.bfloat16)
    ref = ref_w4a16_matmul(x, qweight, scales, zeros)
    out = w4a16_matmul(x, swapped, scales, zeros, interpret=interpret)
    assert max_rel_err(out, ref) > 100 * TOLERANCE["bfloat16"]


def test_empty_batch():
    qweight, scales, zeros = make_weights(64, 32, 32, jnp.bfloat16)
    out = w4a16_matmul(jnp.zeros((0, 64), jnp.bfloat16), qweight, scales, zeros, interpret=True)
    assert out.shape == (0, 32) and out.dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=lambda s: f"k{s[0]}-n{s[1]}")
def test_llama_shapes_on_gpu(shape, on_gpu):
    if not on_gpu:
        pytest.skip("needs --gpu")
    for m in (1, 8, 32, 128):
        check(jnp.bfloat16, m, shape, 128, None, interpret=False)


# ---- the reference's own pieces, by hand --------------------------------------------------------------


def test_pack_int4_by_hand():
    q = np.array([[1, 15], [2, 0], [3, 4], [5, 6]], np.uint8)  # K=4, N=2
    packed = pack_int4(q)
    assert packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, [[0x21, 0x0F], [0x53, 0x64]])
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q))), packed)  # jnp gives the same
    np.testing.assert_array_equal(unpack_int4(packed), q)


def test_dequantize_by_hand():
    q = np.array([[1, 15], [2, 0], [3, 4], [5, 6]], np.uint8)  # K=4, N=2, g=2
    scales = np.array([[0.5, 1.0], [2.0, 0.25]], np.float32)
    zeros = np.array([[8.0, 0.0], [1.0, 4.0]], np.float32)
    want = [[(1 - 8) * 0.5, 15.0], [(2 - 8) * 0.5, 0.0], [(3 - 1) * 2.0, 0.0], [(5 - 1) * 2.0, 0.5]]
    w = dequantize_int4(pack_int4(q), scales, zeros)
    np.testing.assert_array_equal(np.asarray(w), want)
    x = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)
    np.testing.assert_allclose(np.asarray(ref_w4a16_matmul(jnp.asarray(x), pack_int4(q), scales, zeros)),
                               x @ np.asarray(want, np.float32))  # fmt: skip


@pytest.mark.parametrize(
    "q, match",
    [(np.zeros((3, 4), np.uint8), "even K"), (np.full((2, 4), 16, np.uint8), "0..15"),
     (np.zeros((2, 4), np.float32), "integer"), (np.zeros(4, np.uint8), "2-D")],
)  # fmt: skip
def test_pack_int4_rejects(q, match):
    with pytest.raises(ValueError, match=match):
        pack_int4(q)


def test_group_size_of():
    qweight = np.zeros((64, 8), np.uint8)  # K = 128
    assert group_size_of(qweight, np.zeros((4, 8))) == 32
    with pytest.raises(ValueError, match="does not divide"):
        group_size_of(qweight, np.zeros((3, 8)))
    with pytest.raises(ValueError, match="even"):
        group_size_of(np.zeros((3, 8), np.uint8), np.zeros((2, 8)))  # K = 6, g = 3


# ---- the op's argument checks --------------------------------------------------------------------------


def _bad_inputs():
    k, n, g = 256, 64, 64
    qweight, scales, zeros = make_weights(k, n, g, jnp.bfloat16)
    x = make_x(2, k, jnp.bfloat16)
    base = dict(x=x, qweight=qweight, scales=scales, zeros=zeros)
    cases = [
        ({"x": x.astype(jnp.int32)}, "x must be"),
        ({"x": x[None]}, "x must be"),
        ({"qweight": qweight.astype(jnp.int8)}, "qweight must be"),
        ({"qweight": qweight[:-1]}, "qweight must be"),
        ({"scales": scales[:, :-1]}, "scales must be"),
        ({"zeros": zeros.astype(jnp.int32)}, "zeros must be"),
        ({"zeros": zeros[:2]}, "zeros"),
        ({"scales": scales[:3], "zeros": zeros[:3]}, "does not divide K"),
        ({"scales": jnp.ones((16, n)), "zeros": jnp.ones((16, n))}, "group size"),  # g = 16
        ({"qweight": qweight[:, :40], "scales": scales[:, :40], "zeros": zeros[:, :40]}, "N=40"),
        ({"block_n": 48}, "block_n"),
        ({"block_n": 128}, "block_n=128 must divide N"),
        ({"block_m": 8}, "block_m"),
        ({"block_k": 512}, "block_k=512 must divide K"),
        ({"block_k": 24}, "block_k"),
        ({"split_k": 0}, "split_k"),
        ({"split_k": 99}, "split_k"),
        ({"num_warps": 0}, "num_warps"),
    ]
    return [({**base, **change}, match) for change, match in cases]


@pytest.mark.parametrize(
    "inputs, match", _bad_inputs(), ids=[f"{m}-{i}" for i, (_, m) in enumerate(_bad_inputs())]
)
def test_rejects_bad_inputs(inputs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        w4a16_matmul(**inputs, interpret=True)


def test_rejects_block_k_across_groups():
    """g = 96 (K = 576): a step of 64 inputs would straddle two groups."""
    x = make_x(1, 576, jnp.bfloat16)
    qweight, scales, zeros = make_weights(576, 64, 96, jnp.bfloat16)
    with pytest.raises(ValueError, match="one must divide the other"):
        w4a16_matmul(x, qweight, scales, zeros, block_k=64, interpret=True)


# ---- tiles and splits --------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 8, 32, 128, 256])
@pytest.mark.parametrize("shape", LLAMA_SHAPES + [(576, 192), (576, 1536), (1536, 576), (576, 3072)], ids=str)
def test_default_config_is_valid(shape, m):
    """The default tiles pass the op's own checks, and split-K leaves no split without work."""
    k, n = shape
    for g in (32, 128, k):
        if k % g:
            continue
        cfg = default_config(m, k, n, g)
        assert resolve_config(m, k, n, g) == cfg
        steps = k // cfg["block_k"]
        runs = [split_steps(steps, c, cfg["split_k"]) for c in range(cfg["split_k"])]
        assert all(int(hi) > int(lo) for lo, hi in runs), (cfg, runs)


@pytest.mark.parametrize("steps, k", [(16, 8), (9, 4), (56, 8), (5, 5), (7, 1)])
def test_split_steps_cover_every_step_once(steps, k):
    covered = []
    for c in range(k):
        lo, hi = split_steps(steps, jnp.int32(c), k)
        covered += range(int(lo), int(hi))
    assert covered == list(range(steps))


# ---- lowering for the GPU, checked on the CPU ------------------------------------------------------------

LOWER = [  # (M, K, N, g, dtype): decode, a ragged prefill block, per channel, f32, Llama's down
    (1, 4096, 4096, 128, jnp.bfloat16),
    (37, 1536, 576, 32, jnp.float16),
    (3, 576, 192, 576, jnp.bfloat16),
    (128, 4096, 512, 64, jnp.float32),
    (8, 14336, 4096, 128, jnp.bfloat16),
]


def _lower_for_h100(m, k, n, g, dtype):
    """The op lowered for the "cuda" platform with an abstract H100: the HLO text."""
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), dtype), sds((k // 2, n), jnp.uint8), sds((k // g, n), dtype), sds((k // g, n), dtype))
    return lower_for_h100(w4a16_matmul, *args)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("case", LOWER, ids=str)
def test_lowers_to_triton(case):
    """Pallas -> Triton IR (tile shapes, strided-free loads, nibble ops, dot operand types) for sm_90."""
    assert "xla.gpu.triton" in _lower_for_h100(*case)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("case", LOWER[:3], ids=str)
def test_compiles_for_sm90(case, monkeypatch, tmp_path):
    """The Triton IR this op emits, compiled by the `triton` package for sm_90 (no GPU needed): Triton's
    passes (layouts, the dot on mma, software pipelining) accept it, it fits in shared memory, and
    ptxas keeps every value in registers (no spills)."""
    m, k, n, g, _ = case
    cfg = default_config(m, k, n, g)
    assert_compiles_for_sm90(lambda: _lower_for_h100(*case), cfg, monkeypatch, tmp_path)
