"""Sampler against numpy references: greedy, the filtered distributions (statistically, many seeds at
once), seed invariance across batches, penalties, min_tokens suppression, logprobs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from jaxllm.runner.sampler import (
    apply_penalties,
    compute_prompt_logprobs,
    row_keys,
    row_token_logprobs,
    sample_jit,
)
from jaxllm.runner.sampling_metadata import SamplerFlags, SamplingRow, build_sampling_metadata, seed_key_data
from jaxllm.sampling_params import SamplingParams as SP

V = 12


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's order: temperature, min_p, top-k, top-p (no ties in these logits)."""
    x = np.asarray(logits, np.float64) / temperature
    p = _softmax(x)
    x = np.where(p < min_p * p.max(), -np.inf, x)
    if top_k > 0:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = _softmax(x)
    order = np.argsort(-p)
    mass_before = np.cumsum(p[order]) - p[order]
    drop = order[mass_before >= top_p]
    x[drop] = -np.inf
    return _softmax(x)


def _rows(params, n, seed0=0, prompt=(1, 2, 3), output=(), eos=()):
    return [SamplingRow(params, seed0 + i, list(prompt), list(output), tuple(eos)) for i in range(n)]


def _build(rows, num_rows_padded, vocab_size, max_logprobs=None):
    md = build_sampling_metadata(rows, num_rows_padded, vocab_size)
    return md, SamplerFlags.for_rows(rows, max_logprobs, vocab_size)


def _run(logits_row, rows, pad_to=None):
    md, mode = _build(rows, pad_to or len(rows), len(logits_row))
    logits = np.broadcast_to(np.asarray(logits_row, np.float32), (md.num_rows, len(logits_row)))
    return np.asarray(sample_jit(logits, md, flags=mode).token_ids)[: len(rows)], mode


CONFIGS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
]
DRAWS = 4096


def test_distributions_match_reference():
    """Every config in one batch (one compilation): each block of rows must follow its own distribution."""
    logits = np.random.default_rng(0).normal(0.0, 1.5, V).astype(np.float32)
    rows = []
    for i, cfg in enumerate(CONFIGS):
        rows += _rows(SP(**cfg), DRAWS, seed0=i * DRAWS)
    ids, mode = _run(logits, rows)
    assert mode.do_top_k_top_p and not mode.all_greedy
    for i, cfg in enumerate(CONFIGS):
        counts = np.bincount(ids[i * DRAWS : (i + 1) * DRAWS], minlength=V)
        p = ref_probs(logits, **cfg)
        assert counts[p == 0].sum() == 0, (cfg, counts, p)
        support = p > 0
        expected = p[support] * DRAWS
        pvalue = stats.chisquare(counts[support], expected).pvalue
        tv = 0.5 * np.abs(counts / DRAWS - p).sum()
        assert pvalue > 1e-3 and tv < 0.04, (cfg, pvalue, tv)


def test_temperature_only_path_matches_reference():
    """The path that skips the sort (no top-k/top-p/min-p in the batch)."""
    logits = np.random.default_rng(1).normal(0.0, 1.0, V).astype(np.float32)
    ids, mode = _run(logits, _rows(SP(temperature=1.5), DRAWS))
    assert not mode.do_top_k_top_p
    counts = np.bincount(ids, minlength=V)
    assert stats.chisquare(counts, ref_probs(logits, 1.5) * DRAWS).pvalue > 1e-3


def test_greedy_is_argmax():
    logits = np.random.default_rng(2).normal(size=(5, 50)).astype(np.float32)
    rows = _rows(SP(temperature=0.0), 3) + _rows(SP(temperature=1.0, top_k=1), 2)
    md, mode = _build(rows, 8, 50)
    assert mode.all_greedy and mode.num_logprobs == -1
    padded = np.concatenate([logits, np.zeros((3, 50), np.float32)])
    out = np.asarray(sample_jit(padded, md, flags=mode).token_ids)
    np.testing.assert_array_equal(out[:5], logits.argmax(-1))


def test_greedy_rows_in_a_random_batch_take_argmax():
    logits = np.random.default_rng(3).normal(size=(4, 50)).astype(np.float32)
    rows = [
        SamplingRow(SP(temperature=0.0), 1, [1], []),
        SamplingRow(SP(temperature=1.0, top_p=0.5), 2, [1], []),
        SamplingRow(SP(temperature=0.0), 3, [1], []),
        SamplingRow(SP(temperature=2.0), 4, [1], []),
    ]
    md, mode = _build(rows, 4, 50)
    out = np.asarray(sample_jit(logits, md, flags=mode).token_ids)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_row_keys_are_fold_in_of_prng_key():
    seeds, steps = [0, 7, 123456789, 2**32 - 1], [0, 3, 11, 40]
    kd = np.array([seed_key_data(s) for s in seeds], np.uint32)
    got = jax.random.key_data(row_keys(kd, np.array(steps, np.int32)))
    for i, (s, k) in enumerate(zip(seeds, steps, strict=True)):
        want = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(s), k))
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))
    assert seed_key_data(2**40 + 5) == (2**8, 5)


def test_same_seed_same_tokens_whatever_the_batch():
    """A seeded request's k-th token depends only on (seed, k): not on its companions or its row."""
    logits = np.zeros(V, np.float32)  # uniform: the draw is all randomness
    params = SP(temperature=1.0)
    steps = range(24)
    alone = [SamplingRow(params, 99, [5], [0] * k) for k in steps]
    ids_alone, _ = _run(logits, alone)

    others = _rows(SP(temperature=0.9, top_k=4, top_p=0.95, min_p=0.01, presence_penalty=0.0), 24, seed0=500)
    mixed = [r for pair in zip(others, reversed(alone), strict=True) for r in pair]
    ids_mixed, mode = _run(logits, mixed, pad_to=64)
    assert mode.do_top_k_top_p
    np.testing.assert_array_equal(ids_mixed[1::2][::-1], ids_alone)

    other_seed = [SamplingRow(params, 100, [5], [0] * k) for k in steps]
    assert not np.array_equal(_run(logits, other_seed)[0], ids_alone)
    assert len(set(ids_alone.tolist())) > 4  # the step index changes the key


def test_penalties_hand_computed():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]], np.float32)
    hist = np.array([[0, 1, 1, 3, 3, -1, -1]], np.int32)  # prompt [0, 1], output [1, 3, 3]
    is_out = np.array([[0, 0, 1, 1, 1, 0, 0]], bool)
    got = apply_penalties(logits, hist, is_out, np.float32([0.3]), np.float32([0.5]), np.float32([2.0]))
    # repetition (prompt + output): 0: 2/2, 1: -1*2, 3: 3/2; then output counts {1: 1, 3: 2}:
    # 1: -2 - 0.5*1 - 0.3, 3: 1.5 - 0.5*2 - 0.3
    want = [1.0, -2.8, 0.5, 0.2, -2.0, 0.0]
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)


def test_penalties_in_sample_apply_to_greedy_rows_only_where_asked():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 0.0], np.float32)
    penal = SP(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    presence_only = SP(temperature=0.0, presence_penalty=2.0)
    rows = [
        SamplingRow(penal, 0, [0, 1], [1, 3, 3]),
        SamplingRow(SP(temperature=0.0), 0, [0, 1], [1, 3, 3]),
        SamplingRow(presence_only, 0, [3, 3, 3], [0]),  # prompt tokens get no presence penalty
    ]
    md, mode = _build(rows, 4, 6)
    assert mode.do_penalties and md.history_ids.shape == (4, 64)
    np.testing.assert_array_equal(md.history_is_output[0, :6], [0, 0, 1, 1, 1, 0])
    out = np.asarray(sample_jit(np.tile(logits, (4, 1)), md, flags=mode).token_ids)
    assert out[:3].tolist() == [0, 3, 3]


def test_no_penalties_no_history():
    md, mode = _build(_rows(SP(temperature=0.5), 2), 4, V)
    assert not mode.do_penalties and md.history_ids.shape == (4, 0)


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = np.array([0.0, 1.0, 9.0, 0.0, 0.0, 8.0, 7.0, 0.0], np.float32)  # eos=2, stop id 5
    p = SP(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    rows = [
        SamplingRow(p, 0, [1], [4], 2),  # 1 < 3 outputs: 2 and 5 are suppressed
        SamplingRow(p, 0, [1], [4, 4, 4], 2),  # reached min_tokens
        SamplingRow(p.clone(ignore_eos=True), 0, [1], [4], (2,)),  # eos allowed, 5 still not
    ]
    md, mode = _build(rows, 4, 8)
    np.testing.assert_array_equal(md.suppress_ids[:3, :2], [[2, 5], [-1, -1], [5, -1]])
    out = np.asarray(sample_jit(np.tile(logits, (4, 1)), md, flags=mode).token_ids)
    assert out[:3].tolist() == [6, 2, 2]


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_and_ranks_match_numpy():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(4, 40)).astype(np.float32)
    rows = [
        SamplingRow(SP(temperature=1.0, logprobs=3), 5, [1], []),
        SamplingRow(SP(temperature=0.0, logprobs=1), 6, [1], []),
        SamplingRow(SP(temperature=2.0, top_k=10, presence_penalty=1.0, logprobs=0), 7, [1], [3]),
        SamplingRow(SP(temperature=1.0), 8, [1], []),
    ]
    md, mode = _build(rows, 4, 40)
    assert mode.num_logprobs == 3
    out = sample_jit(logits, md, flags=mode)
    ids = np.asarray(out.token_ids)
    lp = _np_log_softmax(logits)
    lp_ids, lps, ranks = (np.asarray(a) for a in (out.logprob_ids, out.logprobs, out.ranks))
    assert lp_ids.shape == (4, 4)
    for r in range(4):
        assert lp_ids[r, 0] == ids[r]
        np.testing.assert_allclose(lps[r, 0], lp[r, ids[r]], rtol=1e-5, atol=1e-5)
        assert ranks[r, 0] == 1 + (lp[r] > lp[r, ids[r]]).sum()
        top = np.argsort(-lp[r])[:3]
        np.testing.assert_array_equal(lp_ids[r, 1:], top)
        np.testing.assert_allclose(lps[r, 1:], lp[r, top], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(ranks[r, 1:], [1, 2, 3])
    assert ranks[1, 0] == 1  # greedy row: its token is the mode of the raw distribution
    one = row_token_logprobs(lp_ids, lps, ranks, 1, 1)
    assert one.token_ids.shape == (1, 2) and one.token_ids[0, 0] == ids[1]


def test_prompt_logprobs_match_numpy():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 30)).astype(np.float32)
    nxt = rng.integers(0, 30, 6).astype(np.int32)
    ids, lps, ranks = (
        np.asarray(a) for a in jax.jit(compute_prompt_logprobs, static_argnums=2)(logits, nxt, 2)
    )
    lp = _np_log_softmax(logits)
    np.testing.assert_array_equal(ids[:, 0], nxt)
    np.testing.assert_allclose(lps[:, 0], lp[np.arange(6), nxt], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ranks[:, 0], 1 + (lp > lp[np.arange(6), nxt][:, None]).sum(-1))
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-lp, -1)[:, :2])


@pytest.mark.parametrize(
    "kw, match",
    [(dict(num_rows_padded=1), "num_rows_padded"), (dict(history_width=2), "history_width")],
)
def test_build_validates(kw, match):
    rows = _rows(SP(repetition_penalty=1.2), 2)
    args = dict(num_rows_padded=4, history_width=None) | kw
    with pytest.raises(ValueError, match=match):
        build_sampling_metadata(rows, args["num_rows_padded"], V, history_width=args["history_width"])


def test_build_top_k_and_greedy_rows():
    rows = [SamplingRow(SP(temperature=0.0), 0, [1], []), SamplingRow(SP(top_k=V + 5), 0, [1], [])]
    md, mode = _build(rows, 4, V)
    assert md.temperature.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert md.top_k.tolist() == [0, 0, 0, 0] and not mode.do_top_k_top_p
    assert md.is_greedy.tolist() == [True, False, True, True]


def test_rows_that_do_not_sample_are_padding():
    rows = [SamplingRow(SP(temperature=0.0, repetition_penalty=1.5, logprobs=2), 0, [1, 2], [3]), None]
    md = build_sampling_metadata(rows, 4, V, history_width=16)
    flags = SamplerFlags.for_rows(rows, max_logprobs=5)
    assert flags == SamplerFlags(all_greedy=True, do_penalties=True, num_logprobs=5)
    assert md.history_ids.shape == (4, 16) and (md.history_ids[1:] == -1).all()
    assert md.is_greedy[1] and (md.suppress_ids[1] == -1).all()


def test_flags_variants_and_ahead_of_time_metadata():
    variants = SamplerFlags.all_variants(max_logprobs=20)
    assert len(set(variants)) == len(variants) == 15
    rows = [SamplingRow(SP(temperature=0.5, top_p=0.9, frequency_penalty=0.1, logprobs=1), 3, [1], [])]
    assert SamplerFlags.for_rows(rows, 20) in variants
    assert SamplerFlags.for_rows(rows) == SamplerFlags(False, True, True, 1)
    # an empty batch built for a penalty program has the same shapes as a real one of the same width
    empty = build_sampling_metadata([], 4, V, history_width=64, flags=SamplerFlags(do_penalties=True))
    real = build_sampling_metadata(rows, 4, V, history_width=64)
    assert jax.tree.map(np.shape, empty) == jax.tree.map(np.shape, real)
    with pytest.raises(ValueError, match="max_logprobs"):
        SamplerFlags.for_rows(rows, max_logprobs=0)
