"""Async scheduling (step N+1 scheduled and dispatched while step N runs, its decode inputs taken from N's
sampled ids on the device) gives exactly the tokens of one-step-at-a-time scheduling: greedy and seeded
random sampling, stop tokens that end a request while its next step is already in flight, min_tokens,
max_tokens, n > 1, logprobs, and preemption. The overlap must actually happen."""

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

MAX_MODEL_LEN = 256


def _workload(vocab: int, n: int = 40, seed: int = 3):
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append(rng.integers(3, vocab, int(rng.integers(1, 50))).tolist())
        kind = i % 5
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True, logprobs=2)
        elif kind == 2:  # stops on frequent ids: requests end while a step for them is in flight
            p = SamplingParams(temperature=1.0, seed=i, max_tokens=16, stop_token_ids=list(range(3, 40)))
        elif kind == 3:
            p = SamplingParams(
                temperature=1.0, seed=i, max_tokens=8, min_tokens=4, stop_token_ids=list(range(3, 60))
            )
        else:
            p = SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=6, ignore_eos=True)
        params.append(p)
    return prompts, params


def _run(path, cache_dir, async_scheduling: bool, **kw):
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        compilation_cache_dir=cache_dir,
        async_scheduling=async_scheduling,
        **kw,
    )
    engine = llm.llm_engine
    overlapped = []
    dispatch = engine.runner.dispatch

    def counting_dispatch(sched, prev=None):
        overlapped.append(prev is not None)
        return dispatch(sched, prev)

    engine.runner.dispatch = counting_dispatch
    vocab = engine.loaded.arch.vocab_size
    prompts, params = _workload(vocab)
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    got = [
        [
            (c.token_ids, c.finish_reason, c.stop_reason, [sorted(d) for d in (c.logprobs or [])])
            for c in o.outputs
        ]
        for o in outs
    ]
    return got, overlapped, engine


@pytest.mark.parametrize(
    "kw",
    [{}, {"num_gpu_blocks_override": 24}],
    ids=["plenty_of_blocks", "preempting"],
)
def test_async_equals_sync(kw, tiny_llama_dir, jax_cache_dir):
    sync, sync_overlap, _ = _run(tiny_llama_dir, jax_cache_dir, False, **kw)
    asyn, async_overlap, engine = _run(tiny_llama_dir, jax_cache_dir, True, **kw)
    assert not any(sync_overlap)
    assert sum(async_overlap) > len(async_overlap) // 2, "steps were not overlapped"
    differ = [i for i, (a, b) in enumerate(zip(sync, asyn)) if a != b]
    assert not differ, f"requests {differ[:6]} differ: {[(sync[i], asyn[i]) for i in differ[:2]]}"
    reasons = {c[1] for o in asyn for c in o}
    assert reasons == {"stop", "length"}
    if kw:
        assert engine.get_stats().num_preemptions > 0
    assert engine.get_stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()
    # The runner kept its own state of each request (built from the plain messages); the last finished
    # ids go out with the next step, which leaves it holding nothing.
    assert engine.step() == [] and len(engine.runner.requests) == 0


def test_penalties_fall_back_to_one_step_at_a_time(tiny_llama_dir, jax_cache_dir):
    llm = LLM(
        tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, compilation_cache_dir=jax_cache_dir
    )
    ref = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        compilation_cache_dir=jax_cache_dir,
        async_scheduling=False,
    )
    p = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5
    )
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    a = [o.outputs[0].token_ids for o in llm.generate(None, p, prompt_token_ids=prompts, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in ref.generate(None, p, prompt_token_ids=prompts, use_tqdm=False)]
    assert a == b


def test_abort_while_a_step_is_in_flight(tiny_llama_dir, jax_cache_dir):
    """Aborting a request whose next step is already on the device frees its blocks, reports it once,
    and leaves the other requests' tokens exactly as without the abort."""

    def make():
        return LLM(
            tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, compilation_cache_dir=jax_cache_dir
        )

    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    ref = make().generate(None, p, prompt_token_ids=prompts, use_tqdm=False)

    engine = make().llm_engine
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, p)
    outs = {}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] = o
    assert engine._inflight is not None, "a step should be in flight after a step with async scheduling"
    aborted = engine.abort_request("1")
    assert [o.request_id for o in aborted] == ["1"]
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["0"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert outs["2"].outputs[0].token_ids == ref[2].outputs[0].token_ids
    assert engine.get_stats().kv_cache_usage == 0.0
