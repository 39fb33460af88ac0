"""The sampler's token rules against plain numpy: the bitmask and logit bias (apply_token_mask), the arrays
build_sampling_metadata makes of TokenConstraints, bad words, and free rows left exactly as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner.sampler import apply_token_mask, sample
from jaxllm.runner.sampling_metadata import SamplerFlags, SamplingRow, build_sampling_metadata
from jaxllm.sampling_params import SamplingParams as SP
from jaxllm.structured_output.token_constraint import (
    TokenConstraint,
    allowed_ids_bitmask,
    bitmask_allows,
    bitmask_width,
)

V = 100  # not a multiple of 32: the last bitmask word is partly padding


def _unpack(mask: np.ndarray, vocab: int) -> np.ndarray:  # bool[S, V]
    return np.unpackbits(mask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)


def test_apply_token_mask_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(3, bitmask_width(V)), dtype=np.int64).astype(np.int32)
    bias_ids = np.array([[5, 99, -1, -1], [-1, -1, -1, -1], [0, 1, 2, -1]], np.int32)
    bias_values = np.array([[100.0, -3.0, 0, 0], [0, 0, 0, 0], [1.5, -2.5, 7.0, 0]], np.float32)
    got = np.asarray(apply_token_mask(jnp.asarray(logits), mask, bias_ids, bias_values))
    want = logits.copy()
    for r in range(3):
        for t, v in zip(bias_ids[r], bias_values[r]):
            if t >= 0:
                want[r, t] += v
    want = np.where(_unpack(mask, V), want, -np.inf)
    np.testing.assert_array_equal(got, want)


def test_allowed_ids_bitmask_sets_exactly_those_bits():
    row = allowed_ids_bitmask([0, 31, 32, 63, 99], V)
    assert row.shape == (bitmask_width(V),) and row.dtype == np.int32
    assert np.flatnonzero(_unpack(row[None], V)[0]).tolist() == [0, 31, 32, 63, 99]
    assert bitmask_allows(row, 31) and bitmask_allows(row, 99) and not bitmask_allows(row, 30)


def test_metadata_of_token_rules():
    allowed = TokenConstraint.create(SP(allowed_token_ids=[3, 4, 70]), V)
    rows = [
        SamplingRow(SP(temperature=0.0), 0, [1], []),
        SamplingRow(SP(temperature=0.0, allowed_token_ids=[3, 4, 70]), 0, [1], [], constraint=allowed),
        SamplingRow(SP(temperature=0.0, logit_bias={7: 2.0, 9: -1.0}), 0, [1], []),
        None,
    ]
    flags = SamplerFlags.for_rows(rows)
    assert flags.do_token_mask
    md = build_sampling_metadata(rows, 8, V, flags=flags)
    allowed_rows = _unpack(md.token_bitmask, V)
    assert allowed_rows[[0, 2, 3, 4, 7]].all()  # free, bias-only and padding rows allow everything
    assert np.flatnonzero(allowed_rows[1]).tolist() == [3, 4, 70]
    assert md.bias_ids.shape == (8, 16) and md.bias_ids[2, :2].tolist() == [7, 9]
    assert md.bias_values[2, :2].tolist() == [2.0, -1.0] and (md.bias_ids[[0, 1, 3]] == -1).all()
    # no token rules: zero-width arrays, the program without the mask
    plain = build_sampling_metadata(rows[:1], 8, V)
    assert plain.token_bitmask.shape == (8, 0) and plain.bias_ids.shape == (8, 0)
    assert not SamplerFlags.for_rows(rows[:1]).do_token_mask


def test_bad_words_banned_after_their_prefix():
    c = TokenConstraint.create(SP(bad_words=["x"]), V, bad_words_token_ids=[[5], [8, 9], [1, 2, 3]])
    assert c is not None and not c.needs_mask and c.needs_last_token  # a word of several tokens
    assert not TokenConstraint.create(SP(bad_words=["x"]), V, bad_words_token_ids=[[5]]).needs_last_token
    assert not TokenConstraint.create(SP(allowed_token_ids=[3]), V).needs_last_token
    assert c.banned_ids([], ()) == [5]
    assert c.banned_ids([4, 8], ()) == [5, 9]
    assert c.banned_ids([4], (8,)) == [5, 9]  # the prefix's last token still in flight
    assert c.banned_ids([1, 2], ()) == [5, 3]
    assert c.banned_ids([1], (2,)) == [5, 3]
    assert c.banned_ids([2, 1], ()) == [5]
    row = SamplingRow(SP(bad_words=["x"]), 0, [1], [4, 8], constraint=c)
    md = build_sampling_metadata([row], 2, V)
    assert sorted(t for t in md.suppress_ids[0] if t >= 0) == [5, 9]


def test_free_rows_unchanged_beside_constrained_rows():
    """Rows 0 and 2 draw at random (seeded) and greedily; their tokens must be the same whether rows 1 and 3
    are free or carry a grammar-like mask and a bias (the program with the token mask)."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(4, V)).astype(np.float32) * 3)
    free = [
        SamplingRow(SP(temperature=0.9, top_p=0.8, seed=3), 11, [1], [2, 3]),
        SamplingRow(SP(temperature=0.7), 12, [1], []),
        SamplingRow(SP(temperature=0.0), 13, [1], [5]),
        SamplingRow(SP(temperature=1.2, top_k=20), 14, [1], []),
    ]
    mask = TokenConstraint.create(SP(allowed_token_ids=[10, 11]), V)
    constrained = list(free)
    constrained[1] = SamplingRow(
        SP(temperature=0.7, allowed_token_ids=[10, 11]), 12, [1], [], constraint=mask
    )
    constrained[3] = SamplingRow(SP(temperature=1.2, top_k=20, logit_bias={42: 100.0}), 14, [1], [])

    def draw(rows):
        flags = SamplerFlags.for_rows(rows)
        md = jax.tree.map(jnp.asarray, build_sampling_metadata(rows, 4, V, flags=flags))
        return flags, np.asarray(sample(logits, md, flags=flags).token_ids)

    f_free, ids_free = draw(free)
    f_con, ids_con = draw(constrained)
    assert not f_free.do_token_mask and f_con.do_token_mask
    assert ids_con[0] == ids_free[0] and ids_con[2] == ids_free[2]
    assert ids_con[1] in (10, 11) and ids_con[3] == 42
