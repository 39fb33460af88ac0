"""Scheduler with speculative decoding: proposals scheduled after a decode's own token, trimmed to what
fits, the KV of rejected ones forgotten, accepted tokens past a stop dropped, and the counts.

The fake runner accepts a proposal when it is the token it would have generated (tests/core/fake_runner.py)
and checks every step that the KV the step attends to is the request's own tokens, so the KV of a rejected
proposal read as context would fail there.
"""

from jaxllm.request import RequestStatus
from tests.core.fake_runner import default_token, expected_tokens
from tests.core.test_scheduler import make, mkreq, plan, step


def decode_to(sched, runner, request):
    """Run steps until the request's prompt is in and it decodes."""
    while request.num_output_tokens == 0:
        step(sched, runner)


def test_right_proposals_are_accepted_and_wrong_ones_forgotten():
    sched, runner = make(budget=64)
    r = mkreq("a", 20, max_tokens=40)
    sched.add_request(r)
    decode_to(sched, runner, r)
    truth = expected_tokens(r, 40)

    # all 3 right: 4 tokens in one step
    r.spec_token_ids = truth[1:4]
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 20, 4)] and out.scheduled[0].spec_token_ids == truth[1:4]
    assert r.output_token_ids == truth[:5]
    assert r.num_computed_tokens == r.num_tokens - 1

    # first right, second wrong: the right one, then the model's own token
    r.spec_token_ids = [truth[5], truth[6] + 1, truth[7]]
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 24, 4)]
    assert r.output_token_ids == truth[:7]
    assert r.num_computed_tokens == r.num_tokens - 1  # the two after the rejected one are forgotten

    # none right: one token, as without proposals; the next plain step reads only real KV
    r.spec_token_ids = [truth[7] + 1]
    step(sched, runner)
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 27, 1)] and not out.scheduled[0].spec_token_ids
    assert r.output_token_ids == truth[:9]
    stats = sched.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (3, 7)
    assert stats.spec_decode_num_accepted_tokens == 4
    assert stats.spec_decode_num_accepted_tokens_per_pos == (2, 1, 1)
    assert (r.spec_num_draft_tokens, r.spec_num_accepted_tokens) == (7, 4)


def test_proposals_are_trimmed_to_max_tokens_budget_and_model_len():
    sched, runner = make(budget=64, max_model_len=40)
    r = mkreq("a", 20, max_tokens=6)
    sched.add_request(r)
    decode_to(sched, runner, r)
    truth = expected_tokens(r, 6)
    r.spec_token_ids = truth[1:6] + [7, 7]  # 7 proposals; 5 more tokens allowed: 4 proposals + 1
    out, _ = step(sched, runner)
    assert out.scheduled[0].spec_token_ids == truth[1:5]
    assert r.output_token_ids == truth and r.status == RequestStatus.FINISHED_LENGTH

    sched, runner = make(budget=3)
    r = mkreq("b", 2, max_tokens=20)
    sched.add_request(r)
    decode_to(sched, runner, r)
    r.spec_token_ids = [1, 2, 3, 4]
    out, _ = step(sched, runner)
    assert plan(out) == [("b", 2, 3)]  # the budget: its own token and two proposals

    sched, runner = make(budget=64, max_model_len=24)
    r = mkreq("c", 20, max_tokens=20)
    sched.add_request(r)
    decode_to(sched, runner, r)
    r.spec_token_ids = [1, 2, 3, 4]
    out, _ = step(sched, runner)
    assert out.scheduled[0].spec_token_ids == [1, 2]  # 21 tokens + 2 proposals + 1 sampled = 24


def test_no_proposals_beside_prompt_chunks_or_a_waiting_request():
    sched, runner = make(budget=64, max_num_seqs=1)
    a = mkreq("a", 20, max_tokens=20)
    sched.add_request(a)
    decode_to(sched, runner, a)
    sched.add_request(mkreq("b", 30, max_tokens=4, base=100))  # waits: max_num_seqs=1
    a.spec_token_ids = expected_tokens(a, 4)[1:4]
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 20, 1)] and not a.spec_token_ids  # dropped, not kept for later

    sched, runner = make(budget=24)
    a, b = mkreq("a", 4, max_tokens=20), mkreq("b", 40, max_tokens=4, base=100)
    sched.add_request(a)
    decode_to(sched, runner, a)
    sched.add_request(b)
    step(sched, runner)  # b's first chunk; b still has a chunk left
    a.spec_token_ids = expected_tokens(a, 5)[2:5]
    out, _ = step(sched, runner)
    assert [s.spec_token_ids for s in out.scheduled] == [[], []]


def test_accepted_tokens_past_a_stop_are_dropped():
    truth = expected_tokens(mkreq("a", 20), 10)
    sched, runner = make(budget=64)
    r = mkreq("a", 20, max_tokens=40, eos=truth[3])
    sched.add_request(r)
    decode_to(sched, runner, r)
    r.spec_token_ids = truth[1:6]
    out = sched.schedule()
    runner_out = runner.execute(out)
    assert runner_out.sampled_token_ids == [truth[1:7]]  # the fake accepted all five
    changed = sched.update_from_output(out, runner_out)
    assert changed == [r] and r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == truth[:4]
    assert runner_out.sampled_token_ids == [truth[1:4]]  # what the engine detokenizes


def test_many_requests_with_random_proposals_stay_consistent():
    """Proposals that are sometimes right over many steps of several requests, with preemption: the fake
    runner's KV checks hold, and every request generates exactly its own tokens."""
    sched, runner = make(budget=32, max_num_seqs=4, num_blocks=12)
    reqs = [mkreq(f"r{i}", 5 + 7 * i, max_tokens=30, base=50 * i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    n = 0
    while sched.has_unfinished_requests():
        for r in sched.running:
            if r.output_token_ids:
                nxt = [default_token(r.request_id, r.num_tokens + j) for j in range(3)]
                r.spec_token_ids = nxt[: 1 + n % 3] + [5]  # right ones, then a wrong one
        step(sched, runner)
        n += 1
        assert n < 200
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r, 30), r.request_id
    stats = sched.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0
