"""The scheduler -> runner message is plain data: new requests once, then deltas, small at any length."""

import pickle

import pytest

from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.request import Request
from jaxllm.runner_output import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tests.core.fake_runner import FakeRunner


def make(num_blocks=600, block_size=16, budget=8192, cpu_blocks=0, seqs=16):
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=4096),
        CacheConfig(block_size=block_size, enable_prefix_caching=False),
        num_gpu_blocks=num_blocks,
        num_cpu_blocks=cpu_blocks,
    )
    return sched, FakeRunner(block_size, num_blocks, cpu_blocks, scheduler=sched)


def step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return out


def _holds_no_request(obj) -> bool:
    """No Request anywhere in the message: only the plain types it declares."""
    if isinstance(obj, Request):
        return False
    if isinstance(obj, list | tuple):
        return all(_holds_no_request(x) for x in obj)
    if isinstance(obj, SchedulerOutput | NewRequestData | ScheduledRequest):
        return all(_holds_no_request(getattr(obj, f)) for f in obj.__slots__)
    return True


def _decode_step_bytes(prompt_len: int, n: int = 8) -> int:
    sched, runner = make()
    for i in range(n):
        sched.add_request(Request(f"r{i}", [7] * prompt_len, SamplingParams(), max_tokens=50))
    step(sched, runner)  # every prompt in one step
    for _ in range(3):  # decodes; no new block is needed at these lengths
        out = step(sched, runner)
    assert [s.num_new_tokens for s in out.scheduled] == [1] * n and not out.new_requests
    assert _holds_no_request(out)
    return len(pickle.dumps(out))


def test_pickled_decode_step_does_not_grow_with_the_token_counts():
    short, long = _decode_step_bytes(20), _decode_step_bytes(1000)
    # Positions grow from 1 to 2 bytes each in the pickle; token lists would add thousands of ids.
    assert long <= short + 2 * 8, (short, long)
    assert long < 100 * 8  # the class names once, then a few dozen bytes per request


def test_new_requests_go_out_once_and_again_when_resumed_after_preemption():
    # 4 usable blocks of 16: a and b fit with 40-token prompts until b's third block is needed.
    sched, runner = make(num_blocks=6, budget=128)
    a = Request("a", list(range(100, 125)), SamplingParams(), max_tokens=20)
    b = Request("b", list(range(200, 225)), SamplingParams(seed=3), max_tokens=20, sampling_seed=77)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched, runner)
    assert [n.req_id for n in out.new_requests] == ["a", "b"]
    nb = out.new_requests[1]
    assert (nb.prompt_token_ids, nb.sampling_seed, nb.output_token_ids) == (b.prompt_token_ids, 77, [])
    assert nb.sampling_params is b.sampling_params and nb.num_computed_tokens == 0
    assert nb.block_ids == [3, 4]
    seen_preemption = False
    while sched.has_unfinished_requests():
        generated_b = list(b.output_token_ids)
        out = step(sched, runner)
        if out.preempted_request_ids:
            assert out.preempted_request_ids == ["b"] and out.new_requests == []
            seen_preemption = True
        elif seen_preemption and out.new_requests:
            # b resumes (recompute): whole again, with what it generated before and its new block table.
            (resumed,) = out.new_requests
            assert resumed.req_id == "b" and resumed.output_token_ids == generated_b
            assert resumed.num_computed_tokens == 0 and len(resumed.block_ids) == 3
            assert out.scheduled[-1].new_block_ids == []
            break
        else:
            assert out.new_requests == []
            # A delta lists exactly the blocks added to the table this step.
            for s in out.scheduled:
                assert len(s.new_block_ids) <= 1
    else:
        raise AssertionError("b was never resumed")


def test_a_result_is_never_applied_to_a_later_request_with_the_same_id():
    sched, runner = make()
    old = Request("x", [5, 6, 7], SamplingParams(), max_tokens=5)
    sched.add_request(old)
    out = sched.schedule()
    result = runner.execute(out)
    sched.abort_requests("x")
    new = Request("x", [9, 9], SamplingParams(), max_tokens=5)  # the id is free again
    sched.add_request(new)
    assert sched.update_from_output(out, result) == []
    assert old.output_token_ids == new.output_token_ids == [] and new.num_output_placeholders == 0
    with pytest.raises(ValueError, match="applied already"):
        sched.update_from_output(out, result)
    with pytest.raises(ValueError, match="not an output"):
        sched.update_from_output(
            SchedulerOutput(scheduled=[ScheduledRequest("x", 2, 0, [])]),
            ModelRunnerOutput(req_ids=["x"], sampled_token_ids=[[4]]),
        )
