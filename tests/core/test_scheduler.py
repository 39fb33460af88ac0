"""Scheduler: budgets, ordering, chunked prefill, preemption, swapping, abort, stop conditions, priority."""

import pytest

from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.request import Request, RequestStatus
from jaxllm.runner_output import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner, expected_tokens


def make(
    budget=64,
    max_num_seqs=8,
    max_model_len=128,
    chunked=True,
    policy="fcfs",
    block_size=16,
    num_blocks=10,
    cpu_blocks=0,
    caching=True,
):
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            policy=policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_gpu_blocks=num_blocks,
        num_cpu_blocks=cpu_blocks,
    )
    return sched, FakeRunner(block_size, num_blocks, cpu_blocks, scheduler=sched)


def mkreq(rid, n_prompt, max_tokens=4, base=0, arrival=None, priority=0, eos=None, **params):
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Request(
        rid,
        list(range(base, base + n_prompt)),
        SamplingParams(**params),
        eos_token_id=eos,
        max_tokens=max_tokens,
        priority=priority,
        **kw,
    )


def step(sched, runner):
    out = sched.schedule()
    changed = sched.update_from_output(out, runner.execute(out))
    return out, changed


def plan(out):
    return [(s.req_id, s.start, s.num_new_tokens) for s in out.scheduled]


def drain(sched, runner, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("did not finish")


def assert_pool_empty(sched):
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])
    assert kv.req_to_blocks == {}
    assert sched.num_free_cpu_blocks == sched.num_cpu_blocks


# -- budgets and order -------------------------------------------------------------------------------------
def test_chunked_prefill_exact_chunks_and_block_tables():
    sched, runner = make(budget=32, num_blocks=10)
    a = mkreq("a", 100, max_tokens=3)
    sched.add_request(a)
    plans = []
    blocks = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        plans.append(plan(out))
        blocks.append(runner.block_table("a"))
    assert plans == [
        [("a", 0, 32)],
        [("a", 32, 32)],
        [("a", 64, 32)],
        [("a", 96, 4)],
        [("a", 100, 1)],
        [("a", 101, 1)],
    ]
    assert blocks[0] == [1, 2] and blocks[3] == [1, 2, 3, 4, 5, 6, 7]
    assert a.output_token_ids == expected_tokens(a, 3)
    assert a.finish_reason == "length"
    assert_pool_empty(sched)


def test_decodes_first_then_prefill_gets_the_rest():
    sched, runner = make(budget=20, num_blocks=20)
    a, b = mkreq("a", 5, max_tokens=10), mkreq("b", 5, max_tokens=10, base=100)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 0, 5), ("b", 0, 5)]
    c = mkreq("c", 50, base=200)
    sched.add_request(c)
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 5, 1), ("b", 5, 1), ("c", 0, 18)]
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 6, 1), ("b", 6, 1), ("c", 18, 18)]
    assert out.num_scheduled_tokens == 20


def test_output_lists_single_token_queries_before_prompt_chunks():
    sched, runner = make(budget=20, num_blocks=20)
    a = mkreq("a", 30, max_tokens=2)
    sched.add_request(a)
    step(sched, runner)
    b = mkreq("b", 1, max_tokens=2, base=100)  # a one-token prompt runs like a decode
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert plan(out) == [("b", 0, 1), ("a", 20, 10)]


def test_max_num_seqs_and_budget_respected():
    sched, runner = make(budget=24, max_num_seqs=3, num_blocks=40)
    reqs = [mkreq(f"r{i}", 7 + i, max_tokens=5, base=10 * i) for i in range(7)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert out.num_scheduled_tokens <= 24
        assert len(out.scheduled) <= 3 and len(sched.running) <= 3
        assert out.num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled)
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r, 5)
    assert_pool_empty(sched)


def test_chunking_off_schedules_whole_prompts_only():
    sched, runner = make(budget=64, max_model_len=64, chunked=False, num_blocks=20)
    a, b = mkreq("a", 40, max_tokens=3), mkreq("b", 40, base=100, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 0, 40)]  # b (40) does not fit in the remaining 24
    out, _ = step(sched, runner)
    assert plan(out) == [("a", 40, 1), ("b", 0, 40)]
    drain(sched, runner)
    assert b.output_token_ids == expected_tokens(b, 3)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)


# -- preemption and swapping -----------------------------------------------------------------------------
def test_preemption_recomputes_most_recent_request():
    # 5 usable blocks of 8 tokens; a and b need 3 blocks each by 17 tokens, so one must give way.
    sched, runner = make(budget=64, block_size=8, num_blocks=6, max_num_seqs=2)
    a = mkreq("a", 7, max_tokens=12, arrival=1.0)
    b = mkreq("b", 7, max_tokens=12, base=100, arrival=2.0)
    c = mkreq("c", 3, max_tokens=2, base=200, arrival=3.0)  # waits: max_num_seqs=2
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = step(sched, runner)  # a: block 1, b: block 2 (7 tokens each)
    assert plan(out) == [("a", 0, 7), ("b", 0, 7)]
    # Grow both until the pool (5 blocks) is short: each needs 3 blocks for 17+ tokens.
    preempted_at = None
    for i in range(20):
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            preempted_at = i
            break
    assert preempted_at is not None
    assert out.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.waiting == [b, c]  # back to the front of the queue
    assert [s.req_id for s in out.scheduled] == ["a"]
    drain(sched, runner)
    assert a.output_token_ids == expected_tokens(a, 12)
    assert b.output_token_ids == expected_tokens(b, 12)
    assert c.output_token_ids == expected_tokens(c, 2)
    assert sched.get_stats().num_preemptions >= 1
    assert_pool_empty(sched)


def test_swap_out_and_in_restores_kv():
    sched, runner = make(budget=64, block_size=8, num_blocks=6, cpu_blocks=8, caching=False)
    a = mkreq("a", 7, max_tokens=12)
    b = mkreq("b", 7, max_tokens=12, base=100)
    sched.add_request(a)
    sched.add_request(b)
    swap_out = swap_in = None
    b_blocks = []  # b's computed blocks before the step
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched, runner)
        if out.blocks_to_swap_out and swap_out is None:
            swap_out = out.blocks_to_swap_out
            assert out.preempted_request_ids == ["b"]
            assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens > 0
            assert sched.get_stats().num_requests_swapped == 1
            assert [d for d, _ in swap_out] == b_blocks
        if out.blocks_to_swap_in:
            swap_in = out.blocks_to_swap_in
            assert [h for _, h in swap_in] == [h for _, h in swap_out]
            assert b.status == RequestStatus.RUNNING
        b_blocks = sched.kv.get_block_ids(b)[: -(-b.num_computed_tokens // 8)]
    assert swap_out and swap_in
    assert len(swap_out) == 2  # b had 15 computed tokens in 8-token blocks
    # The fake runner checked b's context after swap-in; its tokens are unchanged by the round trip.
    assert a.output_token_ids == expected_tokens(a, 12)
    assert b.output_token_ids == expected_tokens(b, 12)
    assert runner.num_swapped_in == runner.num_swapped_out == 2
    assert_pool_empty(sched)


def test_sole_request_that_outgrows_the_pool_finishes_with_length():
    sched, runner = make(budget=64, block_size=8, num_blocks=3)  # 16 slots
    a = mkreq("a", 10, max_tokens=50)
    sched.add_request(a)
    for _ in range(7):
        out, changed = step(sched, runner)
        assert changed == [a] and not a.is_finished
    out, changed = step(sched, runner)  # the 17th token needs a third block
    assert out.scheduled == [] and changed == [a]
    assert out.finished_request_ids == []  # reported to the runner by the next schedule()
    assert sched.schedule().finished_request_ids == ["a"]
    assert a.finish_reason == "length" and a.num_tokens == 17  # 16 computed + the last sampled one
    assert a.output_token_ids == expected_tokens(a, 7)
    assert_pool_empty(sched)


# -- abort and finish --------------------------------------------------------------------------------------
def test_abort_frees_blocks_at_once_and_reports_finished_ids():
    sched, runner = make(budget=32, num_blocks=10)
    a, b = mkreq("a", 40), mkreq("b", 10, base=100)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.kv.num_free_blocks < 9
    sched.abort_requests(["a", "b"])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert_pool_empty(sched)
    out = sched.schedule()
    assert sorted(out.finished_request_ids) == ["a", "b"] and out.is_empty
    assert sched.schedule().finished_request_ids == []
    assert sched.get_request("a") is None


def test_abort_between_schedule_and_update_is_ignored():
    sched, runner = make()
    a = mkreq("a", 5)
    sched.add_request(a)
    out = sched.schedule()
    res = runner.execute(out)
    sched.abort_requests("a")
    assert sched.update_from_output(out, res) == []
    assert a.output_token_ids == []
    assert_pool_empty(sched)


def test_finish_requests_with_stop_status():
    sched, runner = make()
    a = mkreq("a", 5, max_tokens=10)
    sched.add_request(a)
    step(sched, runner)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert a.finish_reason == "stop"
    assert_pool_empty(sched)
    with pytest.raises(ValueError, match="status"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_add_request_validation():
    sched, _ = make(max_model_len=32, num_blocks=3)  # 2 usable blocks of 16
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(mkreq("a", 33))
    sched.add_request(mkreq("fits", 32))
    small, _ = make(max_model_len=32, num_blocks=2)  # 1 usable block of 16
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request(mkreq("a", 17))
    with pytest.raises(ValueError, match="at least one"):
        sched.add_request(mkreq("e", 0))
    sched.add_request(mkreq("b", 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(mkreq("b", 4))


# -- stop conditions ---------------------------------------------------------------------------------------
def scripted(sched, script):
    """A runner output that emits script[rid][k] as the k-th generated token."""

    def run(out):
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in out.scheduled],
            sampled_token_ids=[
                [script[s.req_id][sched.requests[s.req_id].num_output_tokens]] if s.samples else []
                for s in out.scheduled
            ],
        )

    return run


def run_scripted(sched, script):
    run = scripted(sched, script)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        sched.update_from_output(out, run(out))
    raise AssertionError("did not finish")


def test_stop_conditions():
    sched, _ = make(max_model_len=12)
    eos = 2
    reqs = {
        "eos": mkreq("eos", 4, max_tokens=10, eos=eos),
        "ignore": mkreq("ignore", 4, max_tokens=4, eos=eos, ignore_eos=True),
        "min": mkreq("min", 4, max_tokens=10, eos=eos, min_tokens=3, stop_token_ids=[9]),
        "stopid": mkreq("stopid", 4, max_tokens=10, eos=eos, stop_token_ids=[9, 8]),
        "maxtok": mkreq("maxtok", 4, max_tokens=3, eos=eos),
        "maxlen": mkreq("maxlen", 9, max_tokens=100, eos=eos),
    }
    script = {
        "eos": [5, 6, 2, 7],
        "ignore": [2, 2, 2, 2, 2],
        "min": [2, 9, 5, 9, 2],
        "stopid": [5, 8, 9],
        "maxtok": [5, 6, 7, 8],
        "maxlen": [5, 6, 7, 8, 9],
    }
    for r in reqs.values():
        sched.add_request(r)
    run_scripted(sched, script)
    got = {k: (r.output_token_ids, r.finish_reason, r.stop_reason) for k, r in reqs.items()}
    assert got == {
        "eos": ([5, 6, 2], "stop", None),
        "ignore": ([2, 2, 2, 2], "length", None),
        "min": ([2, 9, 5, 9], "stop", 9),
        "stopid": ([5, 8], "stop", 8),
        "maxtok": ([5, 6, 7], "length", None),
        "maxlen": ([5, 6, 7], "length", None),  # 9 + 3 = max_model_len 12
    }
    assert_pool_empty(sched)


# -- policies ----------------------------------------------------------------------------------------------
def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    sched, runner = make(budget=16, policy="priority", num_blocks=20, block_size=16)
    reqs = [
        mkreq("low", 16, priority=5, arrival=1.0),
        mkreq("high", 16, priority=0, arrival=3.0, base=100),
        mkreq("mid", 16, priority=1, arrival=2.0, base=200),
        mkreq("high2", 16, priority=0, arrival=4.0, base=300),
    ]
    for r in reqs:
        sched.add_request(r)
    assert [r.request_id for r in sched.waiting] == ["high", "high2", "mid", "low"]
    order = []
    for _ in range(4):
        out, _ = step(sched, runner)
        order += [s.req_id for s in out.scheduled if s.start == 0]
    assert order == ["high", "high2", "mid", "low"]

    # Victim under pressure: the lowest priority running request, even if admitted first.
    sched, runner = make(budget=64, policy="priority", block_size=8, num_blocks=6)
    lo = mkreq("lo", 7, max_tokens=12, priority=9, arrival=1.0)
    hi = mkreq("hi", 7, max_tokens=12, priority=0, arrival=2.0, base=100)
    sched.add_request(lo)
    sched.add_request(hi)
    preempted = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        preempted += out.preempted_request_ids
    assert preempted and set(preempted) == {"lo"}
    assert lo.output_token_ids == expected_tokens(lo, 12)
    assert_pool_empty(sched)


def test_preempting_an_already_scheduled_request_returns_its_budget():
    sched, runner = make(budget=12, policy="priority", block_size=8, num_blocks=5)  # 4 usable blocks
    lo = mkreq("lo", 7, max_tokens=8, priority=9, arrival=1.0)
    sched.add_request(lo)
    step(sched, runner)
    hi = mkreq("hi", 8, max_tokens=4, priority=0, arrival=2.0, base=100)
    x = mkreq("x", 24, max_tokens=2, priority=1, arrival=3.0, base=200)
    sched.add_request(hi)
    sched.add_request(x)
    out, _ = step(sched, runner)
    assert plan(out) == [("lo", 7, 1), ("hi", 0, 8), ("x", 0, 3)]
    # lo (scheduled first, as a decode) is the victim when hi cannot grow; its token goes to x.
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["lo"]
    assert plan(out) == [("hi", 8, 1), ("x", 3, 11)]
    drain(sched, runner)
    for r, n in ((lo, 8), (hi, 4), (x, 2)):
        assert r.output_token_ids == expected_tokens(r, n)
    assert_pool_empty(sched)


def test_fcfs_waiting_order_and_preempted_goes_to_front():
    sched, runner = make(budget=8, num_blocks=20, block_size=16)
    for i in range(3):
        sched.add_request(mkreq(f"r{i}", 8, base=10 * i))
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2"]
    out, _ = step(sched, runner)
    assert plan(out) == [("r0", 0, 8)]
