"""Speculative decoding (prompt lookup) changes no output: the same batch of requests, with and without
--speculative-config, gives the same tokens for greedy and seeded sampled requests, with logprobs, n > 1,
stop conditions and ineligible requests (penalties, structured outputs) decoding beside them, while
proposals were really made and accepted. Plain decoding is itself checked against transformers elsewhere
(test_batch_invariance.py)."""

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams
from tests.engine.same_outputs import assert_same_outputs

MAX_MODEL_LEN = 512
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PASSAGE = (
    "The river rises in the northern hills, runs south through three old market towns and reaches the "
    "sea at a wide, shallow estuary where thousands of birds spend the winter."
)


def chat(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(prompt, add_special_tokens=False)


def workload(tokenizer):
    prompts = [
        chat(tokenizer, f"Repeat this sentence word for word: {PASSAGE}"),
        chat(tokenizer, f"Copy the text exactly, twice:\n{PASSAGE}"),
        chat(tokenizer, "Name three colours."),  # little to copy
        chat(tokenizer, f"Rewrite in the past tense: {PASSAGE}"),
        chat(tokenizer, f"Repeat this sentence word for word: {PASSAGE}"),
        chat(tokenizer, f"Quote the passage: {PASSAGE}"),
        chat(tokenizer, f"Where does the river reach the sea? {PASSAGE}"),
    ]
    stop = tokenizer.encode(" birds", add_special_tokens=False)[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=48),
        SamplingParams(temperature=0.8, seed=11, max_tokens=40, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=1.0, top_k=20, seed=5, n=2, max_tokens=36),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3),  # ineligible
        SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[stop]),
        SamplingParams(  # token rules: ineligible, its mask filled in the verification steps' sampler
            temperature=0.7,
            seed=2,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex="(At|In) the (estuary|hills)[a-z ]{0,40}"),
        ),
    ]
    return prompts, params


def run(**kw):
    llm = LLM(max_model_len=MAX_MODEL_LEN, **kw)  # the embedded model: it copies text as users' models do
    prompts, params = workload(llm.get_tokenizer())
    outs = llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    return outs, llm.llm_engine.get_stats()


@pytest.fixture(scope="module")
def plain(jax_cache_dir):
    return run(compilation_cache_dir=jax_cache_dir)


def test_same_outputs_with_and_without_speculation(jax_cache_dir, plain):
    """With async scheduling on (the default): steps with proposals run one at a time, the others overlap."""
    ref, ref_stats = plain
    got, stats = run(compilation_cache_dir=jax_cache_dir, speculative_config=SPEC)
    assert ref_stats.spec_decode_num_drafts == 0
    assert_same_outputs(ref, got)
    # Proposals were made and some accepted: the outputs above were produced by verification steps.
    assert stats.spec_decode_num_drafts > 10, stats
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    per_request = [o.metrics.spec_num_accepted_tokens for o in got]
    assert per_request[0] > 0 and per_request[4] == per_request[6] == 0  # penalties, token rules: none
    assert stats.generation_tokens == ref_stats.generation_tokens


def test_verification_steps_run_executables_compiled_ahead(tiny_llama_dir, jax_cache_dir):
    """With compile_ahead, every bucket a verification step can take has its all-rows model step and its
    samplers compiled before ready: decoding with proposals traces nothing through jit."""
    llm = LLM(
        tiny_llama_dir, dtype="float32", max_model_len=256, compilation_cache_dir=jax_cache_dir,
        compile_ahead=True, max_num_seqs=4, max_num_batched_tokens=64, speculative_config=SPEC,
    )  # fmt: skip
    runner = llm.llm_engine.runner
    most = 4 * (1 + SPEC["num_speculative_tokens"])  # every sequence with all its proposals
    top = min(t for t in runner.plan.token_buckets if t >= most)
    assert set(runner.compiler.ahead_all_logits) == {s for s in runner.plan.all_shapes() if s[0] <= top}
    motif = [5, 9, 13, 7, 21]
    prompts = [motif * 6, [3] + motif * 5, motif * 4 + [8, 8]]
    params = [SamplingParams(temperature=t, seed=1, max_tokens=24, ignore_eos=True) for t in (0.0, 0.7, 0.0)]
    llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0
    assert runner.compiler.model_step_traces() == 0
    assert runner.compiler.sample_rows_jit._cache_size() == 0
