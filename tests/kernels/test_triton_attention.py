"""ragged_paged_attention (Pallas) against ref_ragged_paged_attention (plain jnp, float32 softmax).

Default grid: a small set that covers every value of every axis at least once (interpret mode on the
CPU). `-m full_grid`: the product grid. `--gpu` runs both compiled on the GPU. A case's "kv_dtype" is the
pages' dtype (an FP8 KV cache: pages stored with scales, NaN still in the unused ones); the op and the
reference are given the same pages and scales.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.metadata import PagedAttentionMetadata
from jaxllm.kernels.reference import ref_ragged_paged_attention
from jaxllm.kernels.triton_attention import default_config, ragged_paged_attention, split_steps
from jaxllm.kernels.triton_combine import combine_splits, live_rows
from jaxllm.kernels.triton_schedule import WorkItems, active_splits, deal_programs
from jaxllm.testing.kernel_cases import MODES, make_problem, rel_err, tolerance
from tests.kernels.checks import (
    CONTRACT_VIOLATIONS,
    assert_detects_wrong_answer,
    assert_empty_batch_is_zero,
    assert_rejects,
    check_against_reference,
)
from tests.kernels.triton_sm90 import assert_compiles_for_sm90, lower_for_h100

E4M3, E5M2 = {"kv_dtype": jnp.float8_e4m3fn}, {"kv_dtype": jnp.float8_e5m2}

# (mode, dtype, page_size, (hq, hkv), d, extra kwargs; "kv_dtype" goes to the problem, not the op)
SMALL = [
    ("decode", jnp.bfloat16, 16, (8, 2), 128, {}),
    ("decode", jnp.float16, 32, (4, 1), 64, {}),  # MQA
    ("decode", jnp.bfloat16, 16, (8, 2), 64, {"k_splits": 3}),  # split-KV (flash-decoding)
    ("decode", jnp.bfloat16, 64, (6, 2), 256, {}),  # group 3: padded to 4
    ("prefill", jnp.bfloat16, 16, (4, 4), 64, {}),  # MHA
    ("prefill", jnp.float16, 64, (8, 2), 128, {"soft_cap": 5.0}),
    ("mixed", jnp.bfloat16, 16, (8, 2), 64, {}),  # decode rows split off into their own launch
    ("mixed", jnp.bfloat16, 16, (8, 2), 64, {"split_decode": False}),  # one launch, prefill tiles
    ("mixed", jnp.float16, 32, (8, 1), 128, {"sliding_window": 20}),
    ("mixed", jnp.bfloat16, 16, (8, 2), 64, {"block_q": 8, "k_splits": 2}),
    ("chunked", jnp.bfloat16, 16, (8, 2), 128, {"sliding_window": 100, "soft_cap": 30.0}),
    # Loop variants (module docstring of triton_attention.py): one masked loop, page ids carried.
    ("decode", jnp.bfloat16, 16, (8, 2), 128, {"loop_layout": "masked"}),
    ("decode", jnp.float16, 16, (4, 1), 64, {"prefetch_pages": True, "pages_per_block": 1}),
    ("mixed", jnp.bfloat16, 16, (8, 2), 64, {"loop_layout": "masked", "prefetch_pages": True, "k_splits": 2}),
    (
        "chunked",
        jnp.float16,
        16,
        (8, 2),
        128,
        {"prefetch_pages": True, "sliding_window": 100, "soft_cap": 30.0},
    ),
    # FP8 pages: each launch shape (decode, split-KV, prefill tiles, decode rows split off into a prior
    # output, the masked loop with carried ids, soft cap and window), both formats, bf16 and f16 q.
    ("decode", jnp.bfloat16, 16, (8, 2), 128, E4M3),
    ("decode", jnp.bfloat16, 16, (8, 2), 64, {"k_splits": 3, **E5M2}),
    ("prefill", jnp.float16, 64, (8, 2), 128, {"soft_cap": 5.0, **E4M3}),
    ("mixed", jnp.bfloat16, 16, (8, 2), 64, E4M3),
    ("mixed", jnp.float16, 32, (8, 1), 128, {"sliding_window": 20, **E5M2}),
    ("chunked", jnp.bfloat16, 16, (8, 2), 128, {"prefetch_pages": True, "loop_layout": "masked", **E4M3}),
]

# Every loop variant over ragged lengths, splits and a sliding window (three loops with carried ids).
VARIANTS = [
    dict(loop_layout=layout, prefetch_pages=pf, k_splits=ks, pages_per_block=ppb)
    for layout, pf, ks, ppb in itertools.product(["split", "masked"], [False, True], [1, 3], [1, 2])
]

FULL = [
    (mode, dt, ps, heads, d, kv)
    for mode, dt, ps, heads, d, kv in itertools.product(
        list(MODES),
        [jnp.bfloat16, jnp.float16],
        [16, 32, 64],
        [(8, 2), (4, 1), (4, 4), (6, 2)],
        [64, 128, 256],
        [{}, E4M3],
    )
]


def _check(mode, dtype, page_size, heads, d, kw, interpret, seed=0):
    q_lens, kv_lens = MODES[mode]
    hq, hkv = heads
    kw = dict(kw)
    kv_dtype = kw.pop("kv_dtype", None)
    prob = make_problem(
        q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=dtype, seed=seed, kv_dtype=kv_dtype
    )
    check_against_reference(ragged_paged_attention, prob, sm_scale=d**-0.5, interpret=interpret, **kw)


def _id(c):
    mode, dt, ps, (hq, hkv), d, kw = c
    extra = "-".join(f"{k}{jnp.dtype(v).name if k == 'kv_dtype' else v}" for k, v in kw.items())
    return f"{mode}-{jnp.dtype(dt).name}-ps{ps}-h{hq}x{hkv}-d{d}" + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("case", SMALL, ids=_id)
def test_matches_reference(case, interpret):
    _check(*case, interpret=interpret)


@pytest.mark.full_grid
@pytest.mark.parametrize("case", FULL, ids=_id)
def test_matches_reference_full_grid(case, interpret):
    _check(*case, interpret=interpret)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_loop_variants_match_reference(kw, interpret):
    _check("mixed", jnp.bfloat16, 16, (8, 2), 64, {**kw, "sliding_window": 300}, interpret=interpret, seed=1)


@pytest.mark.parametrize("kw", [dict(k_splits=4), dict(k_splits=8, sliding_window=300)], ids=str)
def test_splits_with_a_wide_block_table(kw, interpret):
    """Splits cut each sequence's own context, not the block table's width: a table 4x wider than the
    longest context (as the engine's, max_model_len wide) gives the same answer."""
    q_lens, kv_lens = MODES["decode"]
    prob = make_problem(q_lens, kv_lens, hq=8, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16,
                        extra_table_pages=3 * 64)  # fmt: skip
    check_against_reference(ragged_paged_attention, prob, sm_scale=0.125, interpret=interpret, **kw)


@pytest.mark.parametrize("kw", [{}, dict(split_target=24), dict(split_target=0)], ids=str)
def test_one_long_sequence_in_a_wide_bucket(kw, interpret):
    """A decode bucket of 8 slots holding one long sequence: the launch uses more splits than a full
    bucket would (default), some of its k_splits (a target of 24 programs: 12 splits of 2 KV heads ->
    16), or all of them (target 0); the same answer each time."""
    prob = make_problem(
        [1], [3001], hq=8, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16, pad_rows=7, pad_seqs=7
    )
    assert prob.q.shape[0] == 8 and prob.md.block_tables.shape[0] == 8
    assert default_config(8, 8, 8, 2, 64, 16, 190)["k_splits"] == 48
    check_against_reference(ragged_paged_attention, prob, sm_scale=0.125, interpret=interpret, **kw)


def _items(kv_lens, q_lens):
    kv, q = jnp.array(kv_lens, jnp.int32), jnp.array(q_lens, jnp.int32)
    zero = jnp.zeros_like(kv)
    return WorkItems(seq=zero, q0=zero, q1=q, kv_len=kv, pos0=zero)


@pytest.mark.parametrize(
    "kv_lens, q_lens, hkv, k_splits, target, want",
    [
        ([3000, 0, 0, 0], [1, 0, 0, 0], 8, 32, 264, 32),  # 264 / 8 = 33 -> 64, capped at 32
        ([3000, 5, 0, 0], [1, 1, 0, 0], 8, 32, 264, 32),  # 264 / 16 = 16.5 -> 32
        ([999, 9, 9, 9], [1, 1, 1, 1], 8, 32, 264, 16),  # 264 / 32 = 8.25 -> 16
        ([999, 9, 9, 0], [1, 1, 1, 1], 8, 32, 264, 16),  # an item without keys does not count
        ([999, 9, 9, 9], [1, 1, 1, 0], 8, 32, 264, 16),  # nor one without rows: 264 / 24 = 11 -> 16
        ([300, 0, 0, 0], [1, 0, 0, 0], 8, 32, 264, 5),  # 300 keys: 5 steps of 64
        ([64, 9, 9, 0], [1, 1, 1, 0], 8, 32, 264, 1),  # one step
        ([999] * 4, [1] * 4, 2, 3, 264, 3),  # capped at a k_splits that is no power of two
        ([9] * 4, [1] * 4, 8, 32, 0, 32),  # target 0: all splits
        ([0] * 4, [0] * 4, 8, 32, 264, 1),  # nothing to do
        ([999] * 4, [1] * 4, 8, 1, 264, 1),
    ],
)
def test_active_splits_by_hand(kv_lens, q_lens, hkv, k_splits, target, want):
    got = active_splits(_items(kv_lens, q_lens), hkv=hkv, k_splits=k_splits, target=target, block_k=64)
    assert got.shape == (1,) and int(got[0]) == want


@pytest.mark.parametrize(
    "kv_lens, slots, want",
    [
        ([3000, 0, 0, 0], 33, 32),  # one item: all 32 splits fit in 33 slots
        ([3000, 3000, 3000, 0], 33, 11),  # 264 / 24 -> 16, but 3 items share 33 slots: 11 each
        ([3000] * 4, 4, 1),  # as many slots as items: one split each
    ],
)
def test_active_splits_fit_the_slots(kv_lens, slots, want):
    items = _items(kv_lens, [1] * len(kv_lens))
    got = active_splits(items, hkv=1, k_splits=32, target=264, block_k=64, slots=slots)
    assert int(got[0]) == want


def test_deal_programs_by_hand():
    """Items 0 and 2 have keys (1 has none, 3 no rows): with 3 splits each they take slots 0-2 and 3-5,
    in order; the other slots get item -1."""
    items = _items([50, 0, 70, 9], [1, 1, 1, 0])
    item, split = deal_programs(items, jnp.array([3], jnp.int32), 8)
    assert item.tolist() == [0, 0, 0, 2, 2, 2, -1, -1]
    assert split.tolist()[:6] == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("k, used", [(4, 2), (48, 37)])  # one chunk; three, the last one partly used
def test_combine_reads_only_splits_in_use_and_live_rows(k, used, interpret):
    """Splits at or past `used`, and rows not live, hold whatever was in their buffers (NaN here): the
    merge of a live row is that of the used splits alone (the softmax-weighted mean computed by hand in
    numpy), a dead row comes out zero, and the output has the dtype asked for."""
    rng = np.random.default_rng(0)
    tp, hkv, gp, d = 3, 2, 2, 16
    acc = rng.standard_normal((k, tp, hkv, gp, d)).astype(np.float32)
    m = rng.standard_normal((k, tp, hkv, gp)).astype(np.float32) * 4
    l_ = rng.uniform(0.5, 2.0, (k, tp, hkv, gp)).astype(np.float32)
    live = np.array([1, 0, 1], np.int32)
    w = np.exp2(m[:used])
    want = (acc[:used] * w[..., None]).sum(0) / (l_[:used] * w).sum(0)[..., None]
    want[1] = 0.0
    acc[used:], m[used:], l_[used:] = np.nan, np.nan, np.nan
    acc[:, 1], m[:, 1], l_[:, 1] = np.nan, np.nan, np.nan
    args = [jnp.asarray(x) for x in (acc, m, l_)]
    used_a = jnp.array([used], jnp.int32)
    got = combine_splits(
        *args, used=used_a, live=jnp.asarray(live), out_dtype=jnp.float32, interpret=interpret
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    half = combine_splits(
        *args, used=used_a, live=jnp.asarray(live), out_dtype=jnp.bfloat16, interpret=interpret
    )
    assert half.dtype == jnp.bfloat16
    every = combine_splits(*args, used=jnp.array([k], jnp.int32), live=jnp.ones(tp, jnp.int32),
                           out_dtype=jnp.float32, interpret=interpret)  # fmt: skip
    assert np.isnan(np.asarray(every)).all()


def test_live_rows_by_hand():
    items = WorkItems(
        seq=jnp.zeros(4, jnp.int32),
        q0=jnp.array([0, 1, 3, 6], jnp.int32),
        q1=jnp.array([1, 3, 6, 6], jnp.int32),
        kv_len=jnp.array([5, 0, 9, 0], jnp.int32),  # item 1 (rows 1-2) has no keys; item 3 no rows
        pos0=jnp.zeros(4, jnp.int32),
    )
    assert live_rows(items, 8).tolist() == [1, 0, 0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("lo, hi, k", [(0, 10, 8), (0, 40, 2), (3, 4, 4), (5, 5, 3), (2, 33, 5), (0, 7, 1)])
def test_split_steps_cover_the_range_once(lo, hi, k):
    """The k runs tile [lo, hi) in order with no overlap; each has at most ceil((hi - lo) / k) steps, so
    the longest program of an item is as short as the split count allows."""
    runs = [
        tuple(int(x) for x in split_steps(jnp.int32(lo), jnp.int32(hi), jnp.int32(c), k)) for c in range(k)
    ]
    covered = [i for a, b in runs for i in range(a, b)]
    assert covered == list(range(lo, hi))
    assert max(b - a for a, b in runs) == -(-(hi - lo) // k)


def test_padding_sequences_and_empty_batch(interpret):
    prob = make_problem([1, 2], [5, 9], hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16)
    assert_empty_batch_is_zero(ragged_paged_attention, prob, interpret=interpret)


def test_detects_wrong_answer(interpret):
    prob = make_problem(*MODES["mixed"], hq=8, hkv=2, d=64, page_size=16, dtype=jnp.float16)
    assert_detects_wrong_answer(ragged_paged_attention, prob, interpret=interpret)


@pytest.mark.parametrize("wrong", ["k_scale", "v_scale"])
def test_fp8_scales_are_applied(wrong, interpret):
    """The check can fail on fp8 pages: either scale given wrong (doubled) misses the reference. A kernel
    that ignored k_scale or v_scale would pass only if the check could not see them."""
    prob = make_problem(*MODES["mixed"], hq=8, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16,
                        kv_dtype=jnp.float8_e4m3fn)  # fmt: skip
    ref = ref_ragged_paged_attention(*prob.args(), sm_scale=0.125, **prob.scales())
    scales = {**prob.scales(), wrong: 2 * prob.scales()[wrong]}
    out = ragged_paged_attention(*prob.args(), sm_scale=0.125, interpret=interpret, **scales)
    n = prob.num_rows
    assert rel_err(out[:n], ref[:n]) > 10 * tolerance(jnp.bfloat16)


def test_fp8_scale_as_a_device_array(interpret):
    """Checkpoint scales arrive as f32[] arrays inside the jitted step: same answer as Python floats."""
    prob = make_problem([1, 1, 5], [7, 40, 5], hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16,
                        kv_dtype=jnp.float8_e5m2)  # fmt: skip
    floats = ragged_paged_attention(*prob.args(), sm_scale=0.125, interpret=interpret, **prob.scales())
    arrays = {k: jnp.asarray(v, jnp.float32) for k, v in prob.scales().items()}
    got = ragged_paged_attention(*prob.args(), sm_scale=0.125, interpret=interpret, **arrays)
    assert rel_err(got, floats) == 0.0


BAD_INPUTS = CONTRACT_VIOLATIONS + [
    (lambda a: {**a, "q": a["q"].astype(jnp.int32)}, "dtype"),
    (lambda a: {**a, "sliding_window": 0}, "sliding_window"),
    (lambda a: {**a, "soft_cap": -1.0}, "soft_cap"),
    (lambda a: {**a, "q_heads": 9}, "q_heads"),
    (lambda a: {**a, "block_q": 3}, "block_q"),
    (lambda a: {**a, "loop_layout": "tiled"}, "loop_layout"),
    (lambda a: {**a, "pages_per_block": 0}, "pages_per_block"),
    (
        lambda a: {
            **a,
            "k_pages": a["k_pages"].astype(jnp.float16),
            "v_pages": a["v_pages"].astype(jnp.float16),
        },
        "k_pages/v_pages dtype",
    ),  # fmt: skip
    (lambda a: {**a, "k_pages": a["k_pages"].astype(jnp.float8_e4m3fn)}, "k_pages/v_pages dtype"),
    (
        lambda a: {
            **a,
            "k_scale": jnp.ones((2,), jnp.float32),
            "k_pages": a["k_pages"].astype(jnp.float8_e4m3fn),
            "v_pages": a["v_pages"].astype(jnp.float8_e4m3fn),
        },
        "k_scale",
    ),  # fmt: skip
]


@pytest.mark.parametrize("change, match", BAD_INPUTS, ids=[f"{m}-{i}" for i, (_, m) in enumerate(BAD_INPUTS)])
def test_rejects_bad_inputs(change, match):
    assert_rejects(ragged_paged_attention, change, match, interpret=True)


def test_rejects_loose_metadata_arrays():
    """The metadata is one PagedAttentionMetadata; loose arrays in its place are named in the error."""
    prob = make_problem([1, 2], [5, 9], hq=4, hkv=2, d=64, page_size=16, dtype=jnp.bfloat16)
    md = prob.md
    loose = (md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs)
    with pytest.raises(TypeError, match="md must be a PagedAttentionMetadata"):
        ragged_paged_attention(prob.q, prob.k_pages, prob.v_pages, loose, sm_scale=0.125, interpret=True)


@pytest.mark.parametrize("k, tp, hkv, gp, d", [(64, 8, 8, 4, 128), (4, 16, 2, 1, 64)])
def test_combine_compiles_for_sm90(k, tp, hkv, gp, d, monkeypatch, tmp_path):
    """The merge kernel lowers through Triton for sm_90 without spilling."""
    f32 = jnp.float32
    args = (
        jax.ShapeDtypeStruct((k, tp, hkv, gp, d), f32),
        jax.ShapeDtypeStruct((k, tp, hkv, gp), f32),
        jax.ShapeDtypeStruct((k, tp, hkv, gp), f32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((tp,), jnp.int32),
    )

    def merge(acc, m, l_, used, live):
        return combine_splits(acc, m, l_, used=used, live=live, out_dtype=jnp.bfloat16)

    lower = lambda: lower_for_h100(merge, *args)  # noqa: E731
    assert_compiles_for_sm90(lower, dict(num_warps=4, num_stages=1), monkeypatch, tmp_path, mma=False)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_split_launch_compiles_for_sm90(monkeypatch, tmp_path):
    """The engine's decode bucket of 8 slots at a 131,072-token block table (Llama-3.1-8B heads): the split
    launch, its programs dealt out on the device, compiles for sm_90 without spilling."""
    t, hq, hkv, d, ps, b = 8, 32, 8, 128, 16, 8192
    cfg = default_config(t, t, hq, hkv, d, ps, b)
    assert cfg["k_splits"] == 64
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, hq, d), jnp.bfloat16),
        sds((hkv, 4096, ps, d), jnp.bfloat16),
        sds((hkv, 4096, ps, d), jnp.bfloat16),
        PagedAttentionMetadata(
            kv_lens=sds((t,), jnp.int32),
            block_tables=sds((t, b), jnp.int32),
            cu_q_lens=sds((t + 1,), jnp.int32),
            num_seqs=sds((1,), jnp.int32),
        ),
    )

    def attend(q, k, v, md):
        return ragged_paged_attention(q, k, v, md, sm_scale=d**-0.5)

    lower = lambda: lower_for_h100(attend, *args)  # noqa: E731
    assert_compiles_for_sm90(lower, cfg, monkeypatch, tmp_path, modules_emitted=2)
