"""Padding buckets: every step is padded to one of a few static shapes, all compiled ahead at startup.

Tokens T take powers of two from `min_tokens` up to `max_num_batched_tokens` (which is itself a bucket).
Sequences S follow T: S = min(T, max_num_seqs bucket) — a decode step has T == S, and a prefill step pays
only for empty sequence slots, which the kernels skip. Empty slots are not free everywhere: the LM head
and the sampler run over all S rows (at S=1024, 1.5 ms of LM head alone). So when max_num_seqs exceeds
`SMALL_SEQS`, a T bucket above it also has S = SMALL_SEQS, for steps of few sequences and many tokens
(a prefill chunk beside a few dozen decodes). Pages per sequence B are either the full
`max_model_len / block_size` (GPU kernels read only the pages a sequence uses) or, for the plain-jnp
reference (which gathers every listed page), powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_buckets(lo: int, hi: int, growth: int = 2) -> list[int]:
    out, b = [], _pow2_ceil(lo)
    while b < hi:
        out.append(b)
        b *= growth
    out.append(hi)
    return sorted(set(out))


SMALL_SEQS = 256


def pick(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class BucketPlan:
    token_buckets: tuple[int, ...]
    max_seqs: int
    page_buckets: tuple[int, ...]

    @classmethod
    def build(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        *,
        bucket_pages: bool,
        min_tokens: int = 8,
        growth: int = 2,
        single_token: bool = False,
    ) -> BucketPlan:
        """`growth` 2 on accelerators; 4 on the host, where each compiled variant costs seconds.
        `single_token`: a bucket of one token below `min_tokens`, for the models whose step costs less
        at one row than at `min_tokens` (4-bit weights: one decoding sequence runs the matrix-vector
        kernel, jaxllm/layers/linear.py); elsewhere one sequence pads to `min_tokens` at no cost."""
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        tokens = pow2_buckets(min(min_tokens, max_tokens), max_tokens, growth)
        if single_token and tokens[0] > 1:
            tokens = [1, *tokens]
        pages = (
            pow2_buckets(min(8, max_pages_per_seq), max_pages_per_seq, growth)
            if bucket_pages
            else [max_pages_per_seq]
        )
        return cls(tuple(tokens), _pow2_ceil(max_num_seqs) if max_num_seqs > 1 else 1, tuple(pages))

    def seqs_for(self, t_bucket: int) -> int:
        """The largest S bucket of a T bucket."""
        return min(t_bucket, self.max_seqs)

    def seq_buckets_for(self, t_bucket: int) -> list[int]:
        full = self.seqs_for(t_bucket)
        return sorted({min(full, SMALL_SEQS), full})

    def shape_for(self, num_tokens: int, num_seqs: int, max_pages: int) -> tuple[int, int, int]:
        t = pick(list(self.token_buckets), max(num_tokens, num_seqs))
        s = pick(self.seq_buckets_for(t), num_seqs)
        return t, s, pick(list(self.page_buckets), max(1, max_pages))

    def all_shapes(self) -> list[tuple[int, int, int]]:
        return [
            (t, s, b) for t in self.token_buckets for s in self.seq_buckets_for(t) for b in self.page_buckets
        ]
