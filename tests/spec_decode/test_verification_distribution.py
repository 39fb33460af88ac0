"""Verification keeps the target distribution: the sampler's draws at a request's proposal rows, kept up to
the first that differs from its proposal (the runner's rule), give each token with the model's
probability, whatever was proposed. Checked by chi-square tests over 4,000 seeded requests against the
softmax computed in numpy (fixed seeds: the test gives the same verdict every run), and the first token
of every request is the very token plain decoding draws with the same seed."""

import jax
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxllm.runner.sampler import sample
from jaxllm.runner.sampling_metadata import SamplerFlags, SamplingRow, build_sampling_metadata
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.verify import accepted_tokens

V = 6
N = 4000
LOGITS = np.array(
    [
        [1.0, 0.2, -0.5, 2.0, 0.0, -1.0],  # after the request's own token
        [0.3, 1.5, 0.1, -0.2, 0.9, 0.0],  # after the first proposal
        [-0.4, 0.0, 0.8, 0.5, 1.2, 0.1],  # after the second
    ],
    np.float32,
)


def target(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    x = logits / temperature
    if top_k:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    p = np.exp(x - x.max())
    return p / p.sum()


def draws(params: SamplingParams, num_rows: int) -> np.ndarray:
    """i64[N, num_rows]: request s (seed s) drawn at its rows 0..num_rows-1 as token numbers 0.."""
    rows, pending = [], []
    for s in range(N):
        row = SamplingRow(params, s, [1, 2], [])
        for j in range(num_rows):
            rows.append(row)
            pending.append(j)
    flags = SamplerFlags.for_rows(rows, None, V)
    md = build_sampling_metadata(rows, len(rows), V, flags=flags, pending=pending)
    logits = np.tile(LOGITS[:num_rows], (N, 1))
    out = jax.jit(sample, static_argnames="flags")(logits, md, flags=flags)
    return np.asarray(out.token_ids).reshape(N, num_rows)


def assert_distribution(tokens: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=V)
    keep = p > 0
    assert counts[~keep].sum() == 0, counts
    expected = p[keep].astype(np.float64)
    stat = chisquare(counts[keep], expected / expected.sum() * counts.sum())
    assert stat.pvalue > 1e-3, (counts, np.round(p * len(tokens)))


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
@pytest.mark.parametrize("proposed", [[3, 1], [5, 5]])  # likely ones; unlikely ones
def test_outputs_follow_the_target_distribution(temperature, top_k, proposed):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    x = draws(params, 3)
    out = [accepted_tokens(proposed, row.tolist()) for row in x]
    first = np.array([o[0] for o in out])
    assert_distribution(first, target(LOGITS[0], temperature, top_k))
    # Given the first proposal was accepted, the second token follows the model after it.
    second = np.array([o[1] for o in out if o[0] == proposed[0]])
    if len(second) > 200:
        assert_distribution(second, target(LOGITS[1], temperature, top_k))
    # Plain decoding of the same seeds draws the same first token.
    assert (draws(params, 1)[:, 0] == first).all()


def test_accepting_every_proposal_would_fail_the_check():
    """The check has power: outputs that always take the (unlikely) proposal are refused."""
    params = SamplingParams(temperature=1.0)
    x = draws(params, 2)
    wrong = np.where(np.arange(N) % 2 == 0, 5, x[:, 0])  # half the time the proposal, regardless
    with pytest.raises(AssertionError):
        assert_distribution(wrong, target(LOGITS[0], 1.0, 0))
