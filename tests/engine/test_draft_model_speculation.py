"""Speculative decoding with a draft model changes no output: the same batch, with and without a draft
(`speculative_config={"model": ...}`), gives the same tokens for greedy and seeded sampled requests, with
logprobs, n > 1, a stop token, a prompt longer than a step's token budget (the draft catches up in
chunks) and a penalised request (ineligible) beside them, while the draft's proposals were really made
and verified. Two drafts: a noisy copy of the target's weights (most proposals right, some wrong: both
the accepting and the rejecting path, and the draft cache kept over accepted proposals) and the target
itself (every greedy proposal right). Plain decoding is checked against transformers elsewhere."""

import os
import shutil

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.testing.tiny_models import save_tiny_llama
from tests.engine.same_outputs import assert_same_outputs

MAX_MODEL_LEN = 256
K = 3
ENGINE = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    """The target's folder with every weight perturbed by 1% of its tensor's spread."""
    from safetensors.numpy import load_file, save_file

    folder = str(tmp_path_factory.mktemp("noisy_draft"))
    for name in os.listdir(tiny_llama_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama_dir, name), folder)
    rng = np.random.default_rng(7)
    path = os.path.join(tiny_llama_dir, "model.safetensors")
    weights = {
        k: (v + 0.01 * v.std() * rng.standard_normal(v.shape)).astype(v.dtype)
        for k, v in load_file(path).items()
    }
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def workload():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 380, size=n).tolist() for n in (12, 30, 100, 7, 20, 16)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=32, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),  # 100-token prompt: chunked
        SamplingParams(temperature=1.0, top_k=20, seed=5, n=2, max_tokens=28, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),  # ineligible
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[17]),
    ]
    return prompts, params


def run(model_dir, **kw):
    llm = LLM(model_dir, **ENGINE, **kw)
    prompts, params = workload()
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return llm, outs


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, jax_cache_dir):
    return run(tiny_llama_dir, compilation_cache_dir=jax_cache_dir)[1]


def test_a_noisy_draft_changes_no_output(tiny_llama_dir, noisy_draft_dir, jax_cache_dir, plain):
    spec = {"model": noisy_draft_dir, "num_speculative_tokens": K}
    llm, got = run(tiny_llama_dir, compilation_cache_dir=jax_cache_dir, speculative_config=spec)
    assert_same_outputs(plain, got)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_drafts > 10, stats
    # The noisy draft is mostly right on the greedy requests and sometimes wrong: both paths ran.
    greedy = [got[i].metrics for i in (0, 2, 5)]
    assert sum(m.spec_num_accepted_tokens for m in greedy) > 0.5 * sum(
        m.spec_num_draft_tokens for m in greedy
    )
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    per_request = [o.metrics.spec_num_accepted_tokens for o in got]
    assert per_request[2] > 0  # the long prompt's request speculated once the draft had caught up
    assert per_request[4] == 0  # penalties: never proposed for
    assert stats.generation_tokens == sum(len(c.token_ids) for o in plain for c in o.outputs)


def test_the_target_as_its_own_draft_is_right_on_every_greedy_proposal(tiny_llama_dir, jax_cache_dir, plain):
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": K}
    llm, got = run(tiny_llama_dir, compilation_cache_dir=jax_cache_dir, speculative_config=spec)
    assert_same_outputs(plain, got)
    greedy = [got[i].metrics for i in (0, 2)]
    assert all(m.spec_num_draft_tokens > 0 for m in greedy)
    assert all(m.spec_num_accepted_tokens == m.spec_num_draft_tokens for m in greedy), greedy
    # The draft's cache holds only requests still speculating: a later batch frees the earlier ones'.
    draft = llm.llm_engine.speculator.draft
    llm.generate(
        None, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), prompt_token_ids=[[5, 6, 7]]
    )
    held = sum(len(s.blocks) for s in draft._states.values())
    assert draft.num_requests <= 1
    assert draft.pool.num_free_blocks == draft.pool.num_usable_blocks - held


def test_a_draft_of_another_vocabulary_or_missing_is_refused(tiny_llama_dir, tmp_path):
    other = save_tiny_llama(str(tmp_path / "other"), vocab_size=320, seed=1)
    with pytest.raises(ValueError, match=r"speculative_config.model=.*(tokenizer differs|vocabulary has)"):
        LLM(tiny_llama_dir, **ENGINE, speculative_config={"model": other, "num_speculative_tokens": K})
    missing = str(tmp_path / "no-such-draft")
    with pytest.raises(FileNotFoundError, match=r"speculative_config.model=.*no-such-draft"):
        LLM(tiny_llama_dir, **ENGINE, speculative_config={"model": missing, "num_speculative_tokens": K})


def test_with_compile_ahead_the_draft_traces_nothing_while_decoding(
    tiny_llama_dir, noisy_draft_dir, jax_cache_dir
):
    """compile_ahead compiles the draft's buckets too: its catch-up and decode steps run executables."""
    spec = {"model": noisy_draft_dir, "num_speculative_tokens": K}
    llm = LLM(
        tiny_llama_dir,
        **ENGINE,
        compile_ahead=True,
        compilation_cache_dir=jax_cache_dir,
        speculative_config=spec,
    )
    prompts, params = workload()
    llm.generate(None, params[:3], prompt_token_ids=prompts[:3], use_tqdm=False)
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0
    draft = llm.llm_engine.speculator.draft.runner
    assert draft.num_compiled() > 0 and draft.compiler.model_step_traces() == 0
