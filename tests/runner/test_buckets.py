"""Bucket plans: every step fits the bucket it gets, the smallest that fits, and the plan lists each
shape a step can get (those are what compile ahead)."""

from __future__ import annotations

import itertools

import pytest

from jaxllm.runner.buckets import SMALL_SEQS, BucketPlan


def _plan(tokens, seqs):
    return BucketPlan.build(tokens, seqs, 64, bucket_pages=False)


def test_small_plan_has_one_seq_bucket_per_token_bucket():
    plan = _plan(2048, 256)
    assert plan.token_buckets == (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert [s for _, s, _ in plan.all_shapes()] == [8, 16, 32, 64, 128, 256, 256, 256, 256]


def test_single_token_bucket_sits_below_the_smallest():
    """A model whose one-row step is cheaper (4-bit weights on the matrix-vector kernel) gets a bucket of
    one token: one decoding sequence lands there, two go to the next bucket as before."""
    plan = BucketPlan.build(2048, 256, 64, bucket_pages=False, single_token=True)
    assert plan.token_buckets == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert plan.shape_for(1, 1, 3) == (1, 1, 64)
    assert plan.shape_for(2, 2, 3) == (8, 8, 64)
    assert (1, 1, 64) in plan.all_shapes()


def test_large_plan_adds_the_small_seq_bucket():
    plan = _plan(16384, 1024)
    shapes = plan.all_shapes()
    assert (512, 256, 64) in shapes and (512, 512, 64) in shapes
    assert (16384, SMALL_SEQS, 64) in shapes and (16384, 1024, 64) in shapes
    assert len(shapes) == 12 + 6  # T=512..16384 have two S buckets each
    # A mixed step of 31 decodes and one 512-token chunk: LM head and sampler over 256 rows, not 1024.
    assert plan.shape_for(543, 32, 40) == (1024, 256, 64)
    assert plan.shape_for(1000, 1000, 48) == (1024, 1024, 64)
    assert plan.shape_for(16384, 257, 64) == (16384, 1024, 64)


@pytest.mark.parametrize("tokens, seqs", [(2048, 256), (16384, 1024), (8192, 1024), (512, 64), (64, 300)])
def test_every_step_gets_the_smallest_listed_shape_that_fits(tokens, seqs):
    plan = _plan(tokens, seqs)
    shapes = set(plan.all_shapes())
    top = max(tokens, seqs)
    for n_seq, n_tok in itertools.product([1, 7, 33, 255, 256, 257, 600, seqs], [1, 9, 300, 1025, top]):
        if n_seq > seqs or n_tok > top:
            continue
        n_tok = max(n_tok, n_seq)  # every sequence has at least one token in a step
        shape = plan.shape_for(n_tok, n_seq, 10)
        assert shape in shapes
        t, s, _ = shape
        assert t >= n_tok and s >= n_seq
        fitting = [sh for sh in shapes if sh[0] >= n_tok and sh[1] >= n_seq]
        assert min(fitting) == shape  # smallest T first, then smallest S
