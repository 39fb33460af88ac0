"""compile_all: every step and sampler variant compiled ahead, side by side, and called as executables.
Greedy outputs match the jit path token for token; a failed parallel compile falls back to warming up
one variant at a time through jit, with a warning, and the outputs still match."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.runner.compiler import StepCompiler
from jaxllm.runner.input_batch import empty_step_inputs
from jaxllm.runner.model_runner import MAX_LOGPROBS
from jaxllm.runner.sampler import SamplerFlags
from jaxllm.stats import STEP_HOST_PHASES


def _llm(folder, cache, compile_ahead):
    return LLM(
        folder,
        dtype="float32",
        max_model_len=256,
        compilation_cache_dir=cache,
        compile_ahead=compile_ahead,
        max_num_seqs=16,
        max_num_batched_tokens=64,
    )


def _greedy(llm):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in (5, 70, 17, 33)]
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(None, p, prompt_token_ids=prompts, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def jit_tokens(tiny_llama_dir, jax_cache_dir):
    return _greedy(_llm(tiny_llama_dir, jax_cache_dir, compile_ahead=False))


def test_every_variant_is_an_executable_and_outputs_match(tiny_llama_dir, jax_cache_dir, jit_tokens):
    llm = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=True)
    runner = llm.llm_engine.runner
    shapes = runner.plan.all_shapes()
    assert set(runner.compiler.ahead_model) == set(shapes)
    every = {(s, f) for _, s, _ in shapes for f in SamplerFlags.all_variants(MAX_LOGPROBS)}
    at_start = {key for key in every if key[1].needed_at_start}
    assert at_start and at_start < every
    # Ready with the common variants; penalties and logprobs are compiled or compiling in the background.
    assert at_start <= set(runner.compiler.ahead_sample)
    assert set(runner.compiler.ahead_sample) | set(runner.compiler.pending_sample) == every
    assert _greedy(llm) == jit_tokens
    runner.wait_for_background_compiles()
    assert set(runner.compiler.ahead_sample) == every and not runner.compiler.pending_sample
    # Every step ran an executable compiled ahead: jit never traced the model step nor the sampler
    # (the logprobs variant the requests need was waited for, not compiled twice).
    assert runner.compiler.model_step_traces() == 0
    assert runner.compiler.sample_jit._cache_size() == 0


def test_a_step_waits_for_a_variant_still_compiling(tiny_llama_dir, jax_cache_dir, jit_tokens, monkeypatch):
    """A request that needs a sampler variant still compiling in the background waits for it: same
    tokens, and jit compiles nothing of its own."""
    started = threading.Event()
    compile_lowered = StepCompiler._compile_lowered

    def slow_for_later_variants(lowered, flags):
        if not flags.needed_at_start:
            started.set()
            time.sleep(0.5)
        return compile_lowered(lowered, flags)

    monkeypatch.setattr(StepCompiler, "_compile_lowered", staticmethod(slow_for_later_variants))
    llm = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=True)
    runner = llm.llm_engine.runner
    assert started.wait(30) and runner.num_compiling_in_background() > 0
    assert llm.llm_engine.get_stats().num_compiling_in_background > 0  # what /metrics reports
    assert _greedy(llm) == jit_tokens  # logprobs=2: a variant compiled after ready
    assert runner.compiler.sample_jit._cache_size() == 0
    runner.wait_for_background_compiles()
    assert llm.llm_engine.get_stats().num_compiling_in_background == 0


def test_background_threads_only_compile(tiny_llama_dir, jax_cache_dir, monkeypatch):
    """Every sampler variant is traced before ready, on the thread that builds the engine or its compile
    pool, never on the background threads that run after ready (tracing holds the GIL the steps need)."""
    traced_on = []
    lower_sampler = StepCompiler._lower_sampler

    def recording(self, logits, flags, *rest):
        traced_on.append((threading.current_thread().name, flags.needed_at_start))
        return lower_sampler(self, logits, flags, *rest)

    monkeypatch.setattr(StepCompiler, "_lower_sampler", recording)
    llm = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=True)
    runner = llm.llm_engine.runner
    runner.wait_for_background_compiles()
    every = {(s, f) for _, s, _ in runner.plan.all_shapes() for f in SamplerFlags.all_variants(MAX_LOGPROBS)}
    assert set(runner.compiler.ahead_sample) == every
    later = [name for name, at_start in traced_on if not at_start]
    assert len(later) == sum(not f.needed_at_start for _, f in every)
    assert not [name for name, _ in traced_on if name.startswith("jaxllm-compile-later")], traced_on


def test_failed_parallel_compile_falls_back(tiny_llama_dir, jax_cache_dir, jit_tokens, monkeypatch, caplog):
    def broken(self, *args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(StepCompiler, "_compile_ahead_parallel", broken)
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        llm = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=True)
    assert "parallel ahead-of-time compilation failed" in caplog.text
    runner = llm.llm_engine.runner
    assert runner.compiler.ahead_model == {} and runner.compiler.ahead_sample == {}
    assert runner.compiler.model_step_traces() == len(runner.plan.all_shapes())
    assert _greedy(llm) == jit_tokens


EXIT_CHILD = """
import sys, time
from jaxllm import LLM
from jaxllm.runner.compiler import StepCompiler

compile_lowered = StepCompiler._compile_lowered

def slow_for_later_variants(lowered, flags):
    if not flags.needed_at_start:
        time.sleep(4.0)
    return compile_lowered(lowered, flags)

StepCompiler._compile_lowered = staticmethod(slow_for_later_variants)
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, compilation_cache_dir=sys.argv[2],
          compile_ahead=True, max_num_seqs=16, max_num_batched_tokens=64)
runner = llm.llm_engine.runner
print("READY", runner.num_compiling_in_background(), runner.compiler.background._max_workers, time.time(), flush=True)
"""


def test_exit_does_not_wait_for_queued_background_compiles(tiny_llama_dir, jax_cache_dir, tmp_path):
    """A script that ends right after the engine is ready exits once the variants in hand are done; the
    queued ones (here 4 s each, a minute or more in all) are cancelled, not run."""
    script = tmp_path / "child.py"
    script.write_text(EXIT_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), tiny_llama_dir, jax_cache_dir],
        capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).resolve().parents[2]),
    )  # fmt: skip
    exited = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("READY"))
    _, pending, workers, ready = line.split()
    queue_s = int(pending) * 4.0 / int(workers)  # what running the whole queue would take
    took = exited - float(ready)
    assert queue_s >= 30.0, line
    # The variant in hand (4 s) and the interpreter's teardown, with room for a slow machine.
    assert took < min(4.0 + 12.0, queue_s / 2), f"exit took {took:.1f} s; the queue was {queue_s:.0f} s"


def test_buckets_compile_with_their_tier_of_xla_options(
    tiny_llama_dir, jax_cache_dir, jit_tokens, monkeypatch
):
    """Token buckets up to SMALL_STEP_TOKENS run the model step jitted with SMALL_STEP_OPTIONS, those from
    LARGE_STEP_TOKENS up with LARGE_STEP_OPTIONS, the rest with XLA's defaults, and the options reach XLA:
    an unknown option fails its own tier's steps only."""
    from jaxllm.runner import xla_options

    def options(num_tokens):
        return xla_options.tier_options(xla_options.step_tier(num_tokens))

    assert options(xla_options.SMALL_STEP_TOKENS) == xla_options.SMALL_STEP_OPTIONS
    assert options(xla_options.SMALL_STEP_TOKENS + 1) == {}
    assert options(xla_options.LARGE_STEP_TOKENS - 1) == {}
    assert options(xla_options.LARGE_STEP_TOKENS) == xla_options.LARGE_STEP_OPTIONS
    # This model's token buckets are 8, 32 and 64: one per tier.
    monkeypatch.setattr(xla_options, "SMALL_STEP_TOKENS", 8)
    monkeypatch.setattr(xla_options, "LARGE_STEP_TOKENS", 64)
    llm = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=False)
    runner = llm.llm_engine.runner
    assert _greedy(llm) == jit_tokens  # the same tokens as with every bucket in the small tier
    tiers = {t: xla_options.step_tier(t) for t in runner.plan.token_buckets}
    assert set(tiers.values()) == set(xla_options.STEP_TIERS), tiers
    for t, tier in tiers.items():
        assert runner.compiler.step_jit((t, 1, 1)) is runner.compiler.model_steps[tier]
    # _greedy's steps take buckets 8 and 64; the loop below compiles every bucket of every tier.
    assert runner.compiler.model_steps["small"]._cache_size() >= 1
    assert runner.compiler.model_steps["large"]._cache_size() >= 1

    for tier, name in (("small", "SMALL_STEP_OPTIONS"), ("large", "LARGE_STEP_OPTIONS")):
        with monkeypatch.context() as m:
            m.setattr(xla_options, name, {"no_such_xla_option": 1})
            runner = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=False).llm_engine.runner
            for shape in runner.plan.all_shapes():
                if tiers[shape[0]] == tier:
                    with pytest.raises(Exception, match="no_such_xla_option"):
                        runner._run_model(empty_step_inputs(shape), all_logits=False)
                else:
                    runner._run_model(empty_step_inputs(shape), all_logits=False)  # compiles


def test_stats_count_steps_and_device_wait(tiny_llama_dir, jax_cache_dir):
    """get_stats (what /metrics reports) counts device steps: one request of a 5-token prompt and 6 output
    tokens takes 6 (the prefill samples the first token); the device-wait seconds grow with them."""
    llm = _llm(tiny_llama_dir, jax_cache_dir, compile_ahead=False)
    before = llm.llm_engine.get_stats()
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(None, p, prompt_token_ids=[[5, 6, 7, 8, 9]], use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.llm_engine.get_stats()
    assert after.num_steps - before.num_steps == 6
    assert after.step_device_wait_s > before.step_device_wait_s
    # Each host phase ran and took time; with the wait they fit in the wall time of generate (the phases
    # of one thread do not overlap each other).
    host = {ph: after.step_host_s.get(ph, 0.0) - before.step_host_s.get(ph, 0.0) for ph in STEP_HOST_PHASES}
    assert all(v > 0 for v in host.values()), host
    assert sum(host.values()) + after.step_device_wait_s - before.step_device_wait_s <= wall
