"""Greedy outputs must not depend on what else is in the batch: alone == batched, with prefix caching on
and off, with chunked prefill forced by a tiny token budget, with preemption by recompute and by swap.
The "alone" reference is itself checked against transformers' greedy generate on a few prompts."""

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

MAX_MODEL_LEN = 256


def _workload(vocab: int, n: int = 64, seed: int = 1):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 40).tolist()  # a shared prefix makes prefix-cache hits possible
    prompts, params = [], []
    for i in range(n):
        length = int(rng.integers(1, 60))
        body = rng.integers(3, vocab, length).tolist()
        prompts.append(shared + body if i % 3 == 0 else body)
        params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 14)), ignore_eos=True))
    return prompts, params


def _make(path, cache_dir, **kw):
    return LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, compilation_cache_dir=cache_dir, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, jax_cache_dir):
    llm = _make(tiny_llama_dir, jax_cache_dir, enable_prefix_caching=False)
    vocab = llm.llm_engine.loaded.arch.vocab_size
    prompts, params = _workload(vocab)
    alone = [
        llm.generate(None, p, prompt_token_ids=[ids], use_tqdm=False)[0].outputs[0].token_ids
        for ids, p in zip(prompts, params)
    ]
    return prompts, params, alone


def test_alone_matches_transformers(tiny_llama_dir, reference):
    import torch
    from transformers import AutoModelForCausalLM

    prompts, params, alone = reference
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    for ids, p, ours in list(zip(prompts, params, alone))[:6]:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=p.max_tokens, do_sample=False, min_new_tokens=p.max_tokens
            )
        assert out[0, len(ids) :].tolist() == ours


@pytest.mark.parametrize(
    "name,kw",
    [
        ("prefix_on", dict(enable_prefix_caching=True)),
        ("prefix_off", dict(enable_prefix_caching=False)),
        ("chunked_tiny_budget", dict(max_num_batched_tokens=32, max_num_seqs=16)),
        ("preempt_recompute", dict(num_gpu_blocks_override=40)),
        ("preempt_swap", dict(num_gpu_blocks_override=40, swap_space=0.002)),
    ],
)
def test_batched_equals_alone(name, kw, tiny_llama_dir, jax_cache_dir, reference):
    prompts, params, alone = reference
    llm = _make(tiny_llama_dir, jax_cache_dir, **kw)
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    mismatched = [i for i, (a, b) in enumerate(zip(got, alone)) if a != b]
    assert not mismatched, f"{name}: requests {mismatched[:8]} differ from their alone output"
    stats = llm.llm_engine.get_stats()
    if name == "prefix_on":
        assert stats.prefix_cache_hits > 0
    if name == "prefix_off":
        assert stats.prefix_cache_hits == 0
    if name.startswith("preempt"):
        assert stats.num_preemptions > 0
    # Every block is back in the pool once all requests are done.
    assert stats.kv_cache_usage == 0.0
