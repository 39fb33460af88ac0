"""The runner's own request state, driven by the real scheduler's plain messages (no model, no device).

A stand-in for ModelRunner.dispatch / collect keeps RequestStates from the SchedulerOutputs alone and
builds each step's inputs from them; every step is checked against a reference built from the
scheduler's Requests (the truth the runner may no longer read): token ids, block tables, the rows whose
input the previous step is still sampling, and the index k of each sampled token's random key.
Workloads mix chunked prefill, prefix hits shared by n > 1 children, preemption by recompute and by swap,
aborts while a step is in flight, and async scheduling (step N+1 scheduled and dispatched before N's
results are applied)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.request import Request
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.input_batch import build_step_inputs
from jaxllm.runner.request_state import RequestStates
from jaxllm.runner_output import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams

BS = 8
STOP_IDS = list(range(3, 150))


def token_at(req_id: str, position: int) -> int:
    """The id 'sampled' for position `position` of a request: depends only on the id and position."""
    return 3 + (sum(map(ord, req_id)) * 31 + position * 17) % 997


@dataclass
class Dispatched:
    out: object
    states: list
    rows: dict[str, int] = field(default_factory=dict)


class StateRunner:
    """ModelRunner's bookkeeping without the model: tokens come from token_at."""

    def __init__(self, sched: Scheduler, max_len: int):
        self.sched = sched  # read only by the checks, as the reference
        self.states = RequestStates()
        self.plan = BucketPlan.build(256, 16, -(-max_len // BS), bucket_pages=True, growth=2)
        self.num_prev_src_rows = 0

    def dispatch(self, out, prev: Dispatched | None) -> Dispatched:
        states = self.states.update(out)
        inputs = build_step_inputs(out.scheduled, states, self.plan, BS, prev.rows if prev else None)
        self.check(out, states, inputs, prev)
        step = Dispatched(out, states)
        for i, (sr, st) in enumerate(zip(out.scheduled, states)):
            if sr.samples:
                st.num_in_flight += 1
                step.rows[sr.req_id] = i
        return step

    def collect(self, step: Dispatched) -> ModelRunnerOutput:
        sampled = []
        for sr, st in zip(step.out.scheduled, step.states):
            if sr.samples:
                token = token_at(sr.req_id, sr.start + sr.num_new_tokens)
                st.output_token_ids.append(token)
                st.num_in_flight -= 1
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=[s.req_id for s in step.out.scheduled], sampled_token_ids=sampled)

    def check(self, out, states, inputs, prev) -> None:
        """Everything the runner derived from its states equals what the scheduler's Requests say."""
        kv = self.sched.kv
        row = 0
        for i, (sr, st) in enumerate(zip(out.scheduled, states)):
            request = self.sched.requests[sr.req_id]
            table = kv.get_block_ids(request)
            assert st.block_ids == table, sr.req_id
            assert st.prompt_token_ids == request.prompt_token_ids
            assert st.output_token_ids == request.output_token_ids, sr.req_id
            assert st.sampling.seed == request.sampling_seed
            assert st.sampling.params is request.sampling_params
            np.testing.assert_array_equal(inputs.block_tables[i, : len(table)], table)
            assert not inputs.block_tables[i, len(table) :].any()
            tokens = request.all_token_ids
            for j in range(sr.num_new_tokens):
                p = sr.start + j
                assert inputs.positions[row + j] == p
                assert inputs.slot_mapping[row + j] == table[p // BS] * BS + p % BS
                if p < len(tokens):
                    assert inputs.input_ids[row + j] == tokens[p] and inputs.prev_src[row + j] == -1
                else:  # the previous step, still in flight, samples it
                    assert prev is not None and inputs.prev_src[row + j] == prev.rows[sr.req_id]
                    self.num_prev_src_rows += 1
            row += sr.num_new_tokens
            assert inputs.kv_lens[i] == sr.start + sr.num_new_tokens and inputs.cu_q_lens[i + 1] == row
            if sr.samples:  # k of key(seed, k): outputs so far + this request's earlier ones in flight
                k = len(st.output_token_ids) + st.num_in_flight
                assert k == request.num_output_tokens + request.num_output_placeholders - 1, sr.req_id
        assert inputs.num_tokens == row == out.num_scheduled_tokens


def drive(sched: Scheduler, runner: StateRunner, requests, *, overlap: bool, abort_every: int = 0):
    pending = list(requests)
    inflight, unreported, steps, aborted = None, [], 0, set()
    while pending or sched.has_unfinished_requests() or inflight is not None:
        for _ in range(2):
            if pending:
                sched.add_request(pending.pop(0))
        if inflight is None:
            out = sched.schedule()
            out.finished_request_ids[:0], unreported = unreported, []
            inflight = runner.dispatch(out, None)
        current, inflight = inflight, None
        if overlap and current.out.scheduled:
            nxt = sched.schedule()
            if nxt.is_empty:  # as LLMEngine.step: its finished ids go with the next one
                unreported += nxt.finished_request_ids
            else:
                nxt.finished_request_ids[:0], unreported = unreported, []
                inflight = runner.dispatch(nxt, current)
        if abort_every and steps % abort_every == abort_every - 1 and sched.running:
            victim = sched.running[0].request_id  # its step is on the device
            sched.abort_requests(victim)
            aborted.add(victim)
        sched.update_from_output(current.out, runner.collect(current))
        steps += 1
        assert steps < 3000
    return aborted, unreported


def workload(seed: int, max_len: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 2000) for _ in range(24)]
    out = []
    for i in range(24):
        prompt = (
            shared[: rng.choice([0, 9, 24])]
            + [rng.randrange(2000, 3000) for _ in range(rng.randrange(1, 40))]
        )[:50]
        max_tokens = min(rng.randrange(1, 16), max_len - len(prompt))
        # Some stop on frequent ids: they end while their next step is already in flight (async).
        stops = STOP_IDS if i % 3 == 1 else []
        params = SamplingParams(n=2 if i % 5 == 0 else 1, seed=i, stop_token_ids=stops)
        for c in range(params.n):
            out.append(
                Request(f"q{i}-{c}", list(prompt), params, max_tokens=max_tokens, sampling_seed=i * 10 + c)
            )
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "num_blocks,cpu_blocks,abort_every",
    [(200, 0, 0), (24, 0, 0), (24, 16, 0), (200, 0, 7), (24, 16, 5)],
    ids=["roomy", "recompute", "swap", "aborts", "swap_aborts"],
)
def test_states_follow_the_scheduler(overlap, num_blocks, cpu_blocks, abort_every):
    max_len = 80
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=max_len),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        num_gpu_blocks=num_blocks,
        num_cpu_blocks=cpu_blocks,
    )
    runner = StateRunner(sched, max_len)
    reqs = workload(1, max_len)
    stopped = 0
    aborted, unreported = drive(sched, runner, reqs, overlap=overlap, abort_every=abort_every)
    for r in reqs:
        if r.request_id not in aborted:
            want = [token_at(r.request_id, r.num_prompt_tokens + k) for k in range(r.max_tokens)]
            stop = next((k for k, t in enumerate(want) if t in r.sampling_params.stop_token_ids), None)
            assert r.output_token_ids == (want if stop is None else want[: stop + 1]), r.request_id
            stopped += stop is not None
    assert stopped > 0
    stats = sched.get_stats()
    if num_blocks == 24:
        assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    if overlap:
        assert runner.num_prev_src_rows > 0
    # What is left are the requests whose finished ids have not gone out yet; the next message drops them.
    last = sched.schedule()
    last.finished_request_ids[:0] = unreported
    runner.states.update(last)
    assert len(runner.states) == 0
    assert runner.states.num_with_prompt_logprobs == 0


def test_an_unknown_request_is_an_error():
    from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput

    with pytest.raises(ValueError, match="never sent"):
        RequestStates().update(SchedulerOutput(scheduled=[ScheduledRequest("x", 1, 0, [])]))
