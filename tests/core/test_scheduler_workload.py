"""The scheduler driven end to end by the fake runner: mixed workloads, n > 1 prefix reuse, counters."""

import random
from types import SimpleNamespace

import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
from tests.core.fake_runner import FakeRunner, expected_tokens


def make(
    budget, max_model_len, chunked=True, block_size=4, num_blocks=30, cpu_blocks=0, caching=True, seqs=6
):
    # CacheConfig allows block sizes >= 8; the scheduler reads only these two fields, so a stand-in
    # gives the tiny 4-token blocks that make a 30-block pool tight.
    cache = SimpleNamespace(block_size=block_size, enable_prefix_caching=caching)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        cache,
        num_gpu_blocks=num_blocks,
        num_cpu_blocks=cpu_blocks,
    )
    return sched, FakeRunner(block_size, num_blocks, cpu_blocks, scheduler=sched)


def workload(seed, max_model_len):
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 2000) for _ in range(24)]
    reqs = []
    for i in range(30):
        n = rng.randrange(1, 48)
        prompt = (shared[: rng.choice([0, 8, 24])] + [rng.randrange(2000, 3000) for _ in range(n)])[:60]
        max_tokens = min(rng.randrange(1, 20), max_model_len - len(prompt))
        copies = 2 if i % 7 == 0 else 1  # n = 2: children share the prompt
        for c in range(copies):
            reqs.append(Request(f"q{i}-{c}", list(prompt), SamplingParams(), max_tokens=max_tokens))
    return reqs


@pytest.mark.parametrize(
    "chunked,caching,cpu_blocks,num_blocks",
    [
        (True, True, 0, 30),
        (True, False, 0, 30),
        (True, True, 16, 30),
        (False, True, 0, 40),
        (True, True, 0, 200),  # no memory pressure
    ],
)
def test_mixed_workload_finishes_with_expected_tokens_and_no_leak(chunked, caching, cpu_blocks, num_blocks):
    max_model_len = 96
    sched, runner = make(
        budget=96 if not chunked else 32,
        max_model_len=max_model_len,
        chunked=chunked,
        num_blocks=num_blocks,
        cpu_blocks=cpu_blocks,
        caching=caching,
    )
    reqs = workload(0, max_model_len)
    pending = list(reqs)
    steps = 0
    while pending or sched.has_unfinished_requests():
        for _ in range(3):  # arrivals trickle in
            if pending:
                sched.add_request(pending.pop(0))
        out = sched.schedule()
        assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        # A request preempted this step is not rescheduled in the same step (no thrashing).
        assert not set(out.preempted_request_ids) & {s.req_id for s in out.scheduled}
        sched.update_from_output(out, runner.execute(out))
        steps += 1
        assert steps < 2000
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_token_ids == expected_tokens(r, r.max_tokens), r.request_id
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks and kv.req_to_blocks == {}
    assert sched.num_free_cpu_blocks == cpu_blocks
    stats = sched.get_stats()
    assert stats.generation_tokens == sum(r.max_tokens for r in reqs)
    assert stats.prompt_tokens >= sum(r.num_prompt_tokens for r in reqs) - stats.prefix_cache_hits
    if num_blocks == 30:
        assert stats.num_preemptions > 0
    if cpu_blocks:
        assert runner.num_swapped_out > 0 and runner.num_swapped_in == runner.num_swapped_out
    if caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == stats.prefix_cache_queries == 0
    assert stats.kv_cache_usage == 0.0


def test_n2_children_reuse_the_first_ones_prompt_blocks():
    sched, runner = make(budget=64, max_model_len=64, chunked=False, block_size=16, num_blocks=10)
    prompt = list(range(500, 540))  # 40 tokens: 2 full blocks + 8
    kids = [Request(f"p-{i}", list(prompt), SamplingParams(n=2), max_tokens=3) for i in range(2)]
    for k in kids:
        sched.add_request(k)
    out = sched.schedule()
    assert [(s.req_id, s.num_new_tokens) for s in out.scheduled] == [("p-0", 40)]
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    second = out.scheduled[1]
    assert (second.req_id, second.start, second.num_new_tokens) == ("p-1", 32, 8)
    # p-1 is new to the runner: it gets its whole table (the cached prompt blocks of p-0 + its own one).
    assert [n.req_id for n in out.new_requests] == ["p-1"] and out.new_requests[0].num_computed_tokens == 32
    first_table, second_table = sched.kv.get_block_ids(kids[0]), out.new_requests[0].block_ids
    assert second_table[:2] == first_table[:2]
    assert second_table[2] != first_table[2]  # the partial block is private
    assert kids[1].num_cached_tokens == 32 and kids[0].num_cached_tokens == 0
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    assert stats.prompt_tokens == 48
    sched.update_from_output(out, runner.execute(out))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    for k in kids:
        assert k.output_token_ids == expected_tokens(k, 3)
    # Both freed; the shared prompt blocks stay cached for a later request.
    assert sched.kv.pool.num_cached_blocks >= 2
    assert sched.kv.num_free_blocks == 9


def test_stats_snapshot_while_running():
    sched, runner = make(budget=8, max_model_len=64, block_size=16, num_blocks=10)
    a = Request("a", list(range(20)), SamplingParams(), max_tokens=5)
    b = Request("b", list(range(100, 104)), SamplingParams(), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    st = sched.get_stats()
    assert (st.num_requests_running, st.num_requests_waiting) == (1, 1)
    assert st.prompt_tokens == 8 and st.generation_tokens == 0
    assert st.kv_cache_usage == pytest.approx(1 / 9)
    assert st.num_gpu_blocks == 10 and st.block_size == 16


def test_kv_memory_report_between_steps():
    sched, runner = make(budget=64, max_model_len=64, block_size=16, num_blocks=10)
    sched.add_request(Request("a", list(range(20)), SamplingParams(), max_tokens=5))
    sched.add_request(Request("b", list(range(20)), SamplingParams(), max_tokens=5))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    rep = sched.kv_memory_report()
    # a: blocks [1, 2]; b computed in the same step, so no hit: [3, 4]; 20 tokens each.
    assert (rep.num_blocks, rep.used_slots, rep.allocated_slots) == (4, 40, 64)
    assert rep.efficiency == pytest.approx(40 / 64)
    assert not sched.reset_prefix_cache()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.reset_prefix_cache() and sched.kv.pool.num_cached_blocks == 0
