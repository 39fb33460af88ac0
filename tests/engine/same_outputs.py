"""The check speculative decoding's tests share: two runs of the same requests gave the same outputs."""

import pytest


def assert_same_outputs(ref, got) -> None:
    """Each request's samples: the same token ids and finish reasons, and logprobs equal to 1e-4."""
    for r, g in zip(ref, got, strict=True):
        assert len(r.outputs) == len(g.outputs)
        for a, b in zip(r.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids, r.request_id
            assert b.finish_reason == a.finish_reason
            if a.logprobs is not None:
                for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
                    assert pa.keys() == pb.keys()
                    for t in pa:
                        assert pb[t].logprob == pytest.approx(pa[t].logprob, abs=1e-4)
