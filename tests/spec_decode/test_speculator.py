"""Which requests get proposals: eligible decoding ones, not beyond the batch limit, and not after their
gain proved too low; the engine's overlap follows the same rule (`speculating`)."""

from jaxllm.config import SpeculativeConfig
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
from jaxllm.spec_decode.speculator import (
    MIN_GAIN_PER_STEP,
    SWITCH_OFF_AFTER,
    VERIFY_TOKENS,
    Speculator,
    max_speculating_requests,
    max_verification_tokens,
)

CFG = SpeculativeConfig("ngram", 3, 1, 2, None)


def decoding(rid: str, prompt: list[int], output: list[int], **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), max_tokens=100)
    r.output_token_ids = list(output)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_proposals_follow_the_latest_match_for_eligible_decoding_requests():
    s = Speculator(CFG)
    copy = decoding("a", [1, 2, 3, 4, 5, 1, 2], [3])  # ...1 2 3: after the earlier "2 3" came 4 5 1
    penalised = decoding("b", [1, 2, 3, 1, 2], [3], repetition_penalty=1.2)
    grammar = decoding("c", [1, 2, 3, 1, 2], [3], structured_outputs=StructuredOutputsParams(choice=["x"]))
    chunk = decoding("d", [1, 2, 3, 1, 2], [3])
    chunk.num_computed_tokens = 2  # a prompt chunk is left
    assert s.propose([copy, penalised, grammar, chunk]) == 1
    assert copy.spec_token_ids == [4, 5, 1]
    assert penalised.spec_token_ids == grammar.spec_token_ids == chunk.spec_token_ids == []
    assert s.speculating([penalised, grammar]) is False
    assert s.speculating([copy, penalised]) is True


def test_no_proposals_beyond_the_batch_limit():
    most = max_speculating_requests(CFG)
    assert most == VERIFY_TOKENS // 4
    assert max_verification_tokens(CFG, 1024, 8192) == most * 4 <= VERIFY_TOKENS
    assert max_verification_tokens(CFG, 2, 8192) == 8 and max_verification_tokens(CFG, 64, 16) == 16
    assert max_speculating_requests(SpeculativeConfig("ngram", 3, 1, 2, 5)) == 4  # disable_by_batch_size
    s = Speculator(CFG)
    batch = [decoding(f"r{i}", [7, 8, 9, 7, 8], [9]) for i in range(most + 1)]
    assert s.propose(batch) == 0 and not s.speculating(batch)
    assert s.propose(batch[:most]) == most and s.speculating(batch[:most])


def test_a_request_that_gains_too_little_is_switched_off():
    s = Speculator(CFG)
    r = decoding("a", [1, 2, 3, 1, 2], [3])
    for step in range(SWITCH_OFF_AFTER):
        assert s.propose([r]) == 1, step
        r.spec_token_ids = []  # consumed by the scheduler's step
        r.spec_num_draft_tokens += 3  # every proposal rejected
    assert s.speculating([r])
    assert s.propose([r]) == 0 and r.spec_token_ids == []
    assert not s.speculating([r])  # the engine overlaps its steps again

    good = decoding("b", [1, 2, 3, 1, 2], [3])
    for _ in range(3 * SWITCH_OFF_AFTER):
        assert s.propose([good]) == 1
        good.spec_num_accepted_tokens += int(MIN_GAIN_PER_STEP * 4)  # 1 per step: enough
