"""grouped_matmul (Pallas, Triton lowering) against a float64 numpy reference (each group's rows times its
own weights) and against `jax.lax.ragged_dot`, in interpret mode on the CPU; `--gpu` runs them compiled
on the GPU, plus Qwen3-30B-A3B's shapes. On the CPU the Pallas -> Triton lowering for an H100 is checked
too, and, where the `triton` package is installed, its compilation to sm_90 machine code."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.grouped_matmul import default_tiles, group_metadata, grouped_matmul
from tests.kernels.triton_sm90 import assert_compiles_for_sm90, lower_for_h100

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# Largest |out - ref| / max|ref|: the inputs' rounding is the reference's too (it reads the same
# rounded values), so what is left is float32 accumulation order.
TOLERANCE = 1e-5

# (M, K, N, group sizes): empty groups first, last and between; a group over many tiles; rows past the
# sizes' sum; one row; tiles shared by several groups; one group holding every row.
CASES = [
    (37, 64, 48, [5, 0, 20, 3, 0, 9]),
    (1, 32, 16, [0, 1, 0]),
    (130, 96, 80, [64, 1, 63, 0]),
    (20, 32, 32, [3, 4, 0, 2]),
    (64, 128, 256, [64]),
    (50, 48, 64, [1] * 50),
    (300, 64, 32, [0, 0, 150, 0, 149, 0, 0, 1]),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def make(m, k, n, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    rows = jnp.asarray(rng.standard_normal((m, k)), dtype)
    weights = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return rows, weights, jnp.asarray(sizes, jnp.int32)


def reference(rows, weights, sizes) -> np.ndarray:
    rows, weights = np.asarray(rows, np.float64), np.asarray(weights, np.float64)
    out = np.zeros((rows.shape[0], weights.shape[2]))
    start = 0
    for g, count in enumerate(np.asarray(sizes)):
        out[start : start + count] = rows[start : start + count] @ weights[g]
        start += count
    return out


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_matches_reference(case, dtype, interpret):
    rows, weights, sizes = make(*case, dtype)
    out = grouped_matmul(rows, weights, sizes, interpret=interpret)
    assert out.shape == (case[0], case[2]) and out.dtype == jnp.float32
    assert rel_err(out, reference(rows, weights, sizes)) <= TOLERANCE
    past = int(sum(case[3]))
    assert not np.asarray(out[past:]).any()  # rows of no group are zero


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_equals_ragged_dot(case, interpret):
    """The contract of jax.lax.ragged_dot (what layers/moe.py called before), on the same inputs."""
    rows, weights, sizes = make(*case, jnp.float32, seed=3)
    out = grouped_matmul(rows, weights, sizes, interpret=interpret)
    expected = jax.lax.ragged_dot(
        rows, weights, sizes, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_detects_wrong_group(interpret):
    """Rows multiplied by a neighbour's weights must fail the comparison the tests rely on."""
    rows, weights, sizes = make(37, 64, 48, [5, 0, 20, 3, 0, 9], jnp.float32)
    out = grouped_matmul(rows, weights[::-1], sizes, interpret=interpret)
    assert rel_err(out, reference(rows, weights, sizes)) > 0.1


def test_no_rows():
    rows, weights, sizes = make(0, 32, 16, [0, 0], jnp.float32)
    assert grouped_matmul(rows, weights, sizes, interpret=True).shape == (0, 16)


def test_group_metadata_by_hand():
    """Sizes [3, 0, 6, 1] over 10 rows, tiles of 4: group 0 rows 0-2 (tile 0), group 2 rows 3-8 (tiles
    0, 1, 2), group 3 row 9 (tile 2): items (0,t0) (2,t0) (2,t1) (2,t2) (3,t2), then -1 up to
    cdiv(10, 4) + 4 = 7 items."""
    group, tile, starts, ends = group_metadata(jnp.asarray([3, 0, 6, 1], jnp.int32), 10, 4)
    assert np.asarray(group).tolist() == [0, 2, 2, 2, 3, -1, -1]
    assert np.asarray(tile)[:5].tolist() == [0, 0, 1, 2, 2]
    assert np.asarray(starts).tolist() == [0, 3, 3, 9]
    assert np.asarray(ends).tolist() == [3, 3, 9, 10]


def test_items_never_exceed_the_grid():
    """The worst case (every group starting inside a tile) still fits cdiv(M, bm) + E items."""
    rng = np.random.default_rng(0)
    meta = jax.jit(group_metadata, static_argnums=(1, 2))  # one compile per tile size
    e, m = 13, 13 * 8 + 4  # rows past the sizes' sum too
    for _ in range(50):
        bm = int(rng.choice([4, 16]))
        sizes = rng.integers(0, 9, e) * (rng.random(e) < 0.8)  # some groups empty
        group, tile, _, _ = meta(jnp.asarray(sizes, jnp.int32), m, bm)
        real = [(int(g), int(t)) for g, t in zip(np.asarray(group), np.asarray(tile)) if g >= 0]
        start, expected = 0, []
        for g, c in enumerate(sizes):
            if c:
                expected += [(g, t) for t in range(start // bm, (start + c - 1) // bm + 1)]
            start += c
        assert real == expected


def test_default_tiles():
    assert default_tiles(8, 2048, 1536, 128) == dict(
        block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3
    )
    assert default_tiles(32768, 768, 2048, 128)["block_m"] == 64
    assert default_tiles(40, 48, 80, 4)["block_n"] == 16 and default_tiles(40, 48, 80, 4)["block_k"] == 16


@pytest.mark.parametrize(
    "shapes, dtype, match",
    [
        (((4, 32), (2, 32, 16), (2,)), jnp.float32, None),
        (((4, 32), (2, 64, 16), (2,)), jnp.float32, "disagree"),
        (((4, 32), (2, 32, 16), (3,)), jnp.float32, "disagree"),
        (((4, 32), (2, 32, 24), (2,)), jnp.float32, "multiples of 16"),
        (((4, 32), (2, 32, 16), (2,)), jnp.int8, "must be one of"),
        (((4, 32, 1), (2, 32, 16), (2,)), jnp.float32, "takes rows"),
    ],
)
def test_rejects_bad_inputs(shapes, dtype, match):
    rows = jnp.ones(shapes[0], dtype)
    weights = jnp.ones(shapes[1], dtype)
    sizes = jnp.asarray([2] + [0] * (shapes[2][0] - 1), jnp.int32)
    if match is None:
        grouped_matmul(rows, weights, sizes, interpret=True)
        return
    with pytest.raises(ValueError, match=match):
        grouped_matmul(rows, weights, sizes, interpret=True)


# Qwen3-30B-A3B: 128 experts, hidden 2048, expert intermediate 768 (gate|up 1536), 8 experts per token.
QWEN3_MOE = [(2048, 1536), (768, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("kn", QWEN3_MOE, ids=str)
def test_qwen3_moe_shapes_on_gpu(kn, on_gpu):
    if not on_gpu:
        pytest.skip("needs --gpu")
    k, n = kn
    rng = np.random.default_rng(0)
    for tokens in (1, 8, 256, 4096):
        sizes = np.bincount(rng.integers(0, 128, tokens * 8), minlength=128)
        rows, weights, gs = make(tokens * 8, k, n, sizes.tolist(), jnp.bfloat16)
        out = grouped_matmul(rows, weights, gs)
        assert rel_err(out, reference(rows, weights, gs)) <= TOLERANCE


# ---- lowering for the GPU, checked on the CPU ------------------------------------------------------------

LOWER = [(8, 2048, 1536, 128), (2048, 768, 2048, 128), (37, 64, 48, 6)]  # (M, K, N, E), bfloat16


def _lower_for_h100(m, k, n, e):
    """The op lowered for the "cuda" platform with an abstract H100: the HLO text."""
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), jnp.bfloat16), sds((e, k, n), jnp.bfloat16), sds((e,), jnp.int32))
    return lower_for_h100(grouped_matmul, *args)


@pytest.mark.parametrize("case", LOWER, ids=str)
def test_lowers_to_triton(case):
    assert "xla.gpu.triton" in _lower_for_h100(*case)


@pytest.mark.parametrize("case", LOWER[:2], ids=str)
def test_compiles_for_sm90(case, monkeypatch, tmp_path):
    """The Triton IR this op emits, compiled for sm_90 (no GPU needed): the dot on mma, within shared
    memory, no spills."""
    cfg = default_tiles(*case)
    assert_compiles_for_sm90(lambda: _lower_for_h100(*case), cfg, monkeypatch, tmp_path)
