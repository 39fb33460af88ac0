"""Which proposed tokens a step accepts, from what it sampled at each of them.

A request with k proposed tokens d_0..d_{k-1} feeds [last token, d_0, ..., d_{k-1}] to the step, so the
step has the target model's distribution p_j of the token after each prefix, j = 0..k. Its sampler draws
x_j ~ p_j for every j, with the key the request's token number (num_output + j) would get in plain
decoding. The step keeps x_0..x_a, where a is the first j with x_j != d_j (a = k when every proposal
matches): the matching proposals and one more token.

This is exact rejection sampling for a deterministic proposal (q = one-hot at d_j): d_j is accepted with
probability p_j(d_j) = min(1, p_j(d_j) / q(d_j)), and after a rejection x_j is distributed as p_j
restricted to tokens other than d_j, which is the residual norm(max(0, p_j - q)). So outputs keep the
target distribution, and more: token number m is still drawn with key(seed, m) from the same
distribution as without speculation, so a seeded (or greedy) request produces the same tokens with and
without it, whatever was proposed.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(proposed: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a step appends: `sampled` (k + 1 draws, one per proposal and one after the last) up to
    and including the first that differs from its proposal."""
    k = len(proposed)
    if len(sampled) != k + 1:
        raise ValueError(f"{len(sampled)} sampled tokens for {k} proposed ones: need {k + 1}")
    a = 0
    while a < k and sampled[a] == proposed[a]:
        a += 1
    return list(sampled[: a + 1])
