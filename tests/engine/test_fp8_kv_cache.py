"""`kv_cache_dtype="fp8"` end to end on the embedded model (SmolLM2-135M) on the CPU, against the same
engine with the weights' dtype in its cache ("auto": float32 here).

- The cache is allocated in float8_e4m3fn and, at one memory budget, holds twice the blocks of bfloat16
  (four times float32's); the log and startup_info say so.
- Greedy tokens, 8 prompts x 16 tokens: most agree. Counted two ways: the tokens each prompt generates
  before its first difference (after one, the two continuations see different text), and, teacher-forced
  on the float32 engine's tokens, how often the fp8 engine's top token is the same. Logprob drift of the
  chosen tokens is small while the text agrees.
- The perplexity of a fixed text (the standard library's os.py) moves little.

Scales are 1.0 here (the GGUF has none), as vLLM's default: per layer, e4m3's 3 mantissa bits give about
3% per element, and small V values of the first layer fall below e4m3's normal range; the bounds below
were set from measured figures (fp8 vs float32: 4 of 8 prompts identical, 90 of 128 tokens before the
first difference, 120 of 128 teacher-forced top tokens the same, mean drift 0.04 nats, perplexity
+1.5%; a bfloat16 cache: 128 of 128 before the first difference) with room for rounding differences
across machines.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.runner import kv_cache as kvc

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colors:",
    "Once upon a time, in a small village,",
    "Explain what a CPU does in one sentence.",
    "2 + 2 =",
    "The quick brown fox",
]
BUDGET = 32 << 20  # host KV budget (JAXLLM_CPU_KV_CACHE_BYTES): below what max_num_seqs could use
MAX_TOKENS = 16


def _text_chunks() -> list[str]:
    text = open(os.__file__, encoding="utf-8").read()[:4800]
    return [text[i : i + 400] for i in range(0, len(text), 400)]


def _run(kv_cache_dtype: str, cache_dir: str) -> dict:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, log = Keep(level=logging.INFO), logging.getLogger("jaxllm")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kvc, "_CPU_KV_BUDGET_BYTES", BUDGET)
            llm = LLM(
                kv_cache_dtype=kv_cache_dtype,
                max_model_len=256,
                max_num_seqs=16,
                compilation_cache_dir=cache_dir,
            )
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
        for o in outs
    ]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    lps = []
    for o in llm.generate(_text_chunks(), score, use_tqdm=False):
        lps += [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
    engine = llm.llm_engine
    return dict(
        llm=llm,
        engine=engine,
        log=records,
        prompt_ids=[list(o.prompt_token_ids) for o in outs],
        tokens=tokens,
        logprobs=logprobs,
        perplexity=float(np.exp(-np.mean(lps))),
    )


@pytest.fixture(scope="module")
def runs(jax_cache_dir):
    return {kv: _run(kv, jax_cache_dir) for kv in ("auto", "fp8")}


def test_the_cache_is_fp8_and_the_log_says_so(runs):
    engine, log = runs["fp8"]["engine"], runs["fp8"]["log"]
    assert all(
        k.dtype == jnp.float8_e4m3fn and v.dtype == jnp.float8_e4m3fn for k, v in engine.runner.kv_caches
    )
    assert engine.startup_info["kv_cache_dtype"] == "float8_e4m3fn"
    assert engine.startup_info["kv_cache_scales"] == "1.0"  # the GGUF holds no k_scale / v_scale
    (settings,) = [ln for ln in log if ln.startswith("engine config: ")]
    assert "kv_cache_dtype=float8_e4m3fn, kv_cache_scales=1.0" in settings
    auto = runs["auto"]["engine"]
    assert auto.startup_info["kv_cache_dtype"] == "float32" and "kv_cache_scales" not in auto.startup_info


def test_twice_the_blocks_of_bfloat16_at_one_budget(runs, monkeypatch):
    fp8, auto = runs["fp8"]["engine"], runs["auto"]["engine"]
    geo = fp8.runner.geometry
    bf16 = dataclasses.replace(geo, dtype=jnp.dtype(jnp.bfloat16))
    assert bf16.bytes_per_block == 2 * geo.bytes_per_block == auto.runner.geometry.bytes_per_block // 2
    monkeypatch.setattr(kvc, "_CPU_KV_BUDGET_BYTES", BUDGET)
    n_bf16, _ = kvc.num_blocks_for_memory(bf16, 0.9, 0, 1 << 30)  # as the engine sizes it, in bfloat16
    n_fp8, n_f32 = fp8.scheduler.num_gpu_blocks, auto.scheduler.num_gpu_blocks
    assert n_fp8 == BUDGET // geo.bytes_per_block == fp8.runner.kv_caches[0][0].shape[1]
    assert 2 * n_bf16 <= n_fp8 <= 2 * n_bf16 + 1  # twice, but for the floor of each division
    assert 4 * n_f32 <= n_fp8 <= 4 * n_f32 + 3
    kv_gib = fp8.startup_info["kv_cache_gib"]
    assert kv_gib == round(n_fp8 * geo.bytes_per_block / 2**30, 3) <= BUDGET / 2**30


def test_greedy_tokens_mostly_agree_with_small_logprob_drift(runs):
    a, b = runs["auto"], runs["fp8"]
    agree, drift = [], []
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        agree.append(n)
        drift += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    identical = sum(n == MAX_TOKENS for n in agree)
    print(f"fp8 vs auto: {identical}/8 identical, {sum(agree)}/128 tokens before the first difference, "
          f"logprob drift mean {np.mean(drift):.4f} max {np.max(drift):.4f}")  # fmt: skip
    assert identical >= 3
    assert sum(agree) >= 72
    assert np.mean(drift) < 0.1 and np.max(drift) < 0.5


def test_teacher_forced_top_tokens_mostly_agree(runs):
    """The fp8 engine reads each prompt followed by the float32 engine's greedy tokens: at each of those 16
    positions its top token is the float32 engine's at most of them (every position sees the same text,
    so one difference does not carry over to the next)."""
    a, llm = runs["auto"], runs["fp8"]["llm"]
    ids = [p + t[:-1] for p, t in zip(a["prompt_ids"], a["tokens"], strict=True)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(None, score, prompt_token_ids=ids, use_tqdm=False)
    same = 0
    for o, p, t in zip(outs, a["prompt_ids"], a["tokens"], strict=True):
        # prompt_logprobs[j]: the distribution of token j given the tokens before it (rank 1 is the top).
        for j, want in enumerate(t[:-1], start=len(p)):
            same += any(tok == want and lp.rank == 1 for tok, lp in o.prompt_logprobs[j].items())
        same += o.outputs[0].token_ids == [t[-1]]  # the greedy token after all of them
    total = len(PROMPTS) * MAX_TOKENS
    print(f"teacher-forced top-1 agreement fp8 vs auto: {same}/{total}")
    assert same >= 0.85 * total


def test_perplexity_moves_little(runs):
    auto, fp8 = runs["auto"]["perplexity"], runs["fp8"]["perplexity"]
    print(f"perplexity of os.py[:4800] in 400-char chunks: auto {auto:.3f}, fp8 {fp8:.3f}")
    assert abs(fp8 / auto - 1) < 0.04
