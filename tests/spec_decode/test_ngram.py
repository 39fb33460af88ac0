"""Prompt lookup against a plain-Python search, the growing token history, and the acceptance rule."""

import numpy as np
import pytest

from jaxllm.spec_decode.ngram import TokenHistory, propose_ngram
from jaxllm.spec_decode.verify import accepted_tokens


def reference_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: largest n first; the latest earlier occurrence of the last n tokens."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n :]
        for i in range(L - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_hand_computed_cases():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    # last 2 = [5, 6]: at 0 and 5; the latest (5) is followed by 7, 1, 5
    assert propose_ngram(np.array(tokens, np.int32), 2, 2, 3) == [7, 1, 5]
    # last 3 = [1, 5, 6] occurs nowhere earlier: n falls to 2
    assert propose_ngram(np.array(tokens, np.int32), 2, 3, 3) == [7, 1, 5]
    # no earlier match of [9, 4] nor [4]
    assert propose_ngram(np.array([1, 2, 3, 9, 4], np.int32), 1, 2, 3) == []
    # the proposal stops at the end of the known tokens
    assert propose_ngram(np.array([3, 4, 3], np.int32), 1, 1, 5) == [4, 3]
    assert propose_ngram(np.array([3], np.int32), 1, 1, 5) == []


@pytest.mark.parametrize("vocab", [3, 8])
def test_matches_the_reference_on_random_sequences(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(400):
        tokens = rng.integers(0, vocab, rng.integers(1, 60)).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        got = propose_ngram(np.array(tokens, np.int32), lo, hi, k)
        assert got == reference_propose(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_token_history_follows_the_growing_lists():
    h = TokenHistory()
    prompt, output = list(range(300)), []
    assert h.sync(prompt, output).tolist() == prompt
    for t in range(400):
        output.append(t % 7)
        if t % 3 == 0:
            assert h.sync(prompt, output).tolist() == prompt + output
    assert h.sync(prompt, output).tolist() == prompt + output
    assert h.sync([1, 2], []).tolist() == [1, 2]  # shorter: a different request, started over


def test_accepted_tokens():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_tokens([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accepted_tokens([], [3]) == [3]
    with pytest.raises(ValueError, match="need 3"):
        accepted_tokens([1, 2], [1, 2])
