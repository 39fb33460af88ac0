"""Scheduler limits left unset follow vLLM's table (device memory, A100 or not, offline or server); limits
the user gives are kept as given; the step-memory estimate covers the widest sampler variant."""

from __future__ import annotations

import jax
import pytest

from jaxllm import LLM
from jaxllm.engine.batch_defaults import HOST_LIMITS, default_batch_limits, device_total_memory
from jaxllm.runner.model_runner import MAX_LOGPROBS
from jaxllm.runner.sampler import SamplerFlags

GIB = 2**30


@pytest.mark.parametrize(
    "usage, platform, memory, kind, expected",
    [
        ("offline", "gpu", 141 * GIB, "NVIDIA H200", (1024, 16384)),
        ("server", "gpu", 141 * GIB, "NVIDIA H200", (1024, 8192)),
        ("offline", "gpu", 80 * GIB, "NVIDIA H100 80GB HBM3", (1024, 16384)),
        ("offline", "gpu", 80 * GIB, "NVIDIA A100-SXM4-80GB", (256, 8192)),  # A100: vLLM keeps it small
        ("server", "gpu", 80 * GIB, "NVIDIA A100-SXM4-80GB", (256, 2048)),
        ("offline", "gpu", 24 * GIB, "NVIDIA L4", (256, 8192)),
        ("server", "gpu", None, "", (256, 2048)),  # memory not reported: the small table
        ("offline", "cpu", 512 * GIB, "cpu", HOST_LIMITS),
        ("server", "cpu", None, "cpu", HOST_LIMITS),
    ],
)
def test_vllm_table(usage, platform, memory, kind, expected):
    assert default_batch_limits(usage, platform, memory, kind) == expected


def test_unknown_usage_is_named():
    with pytest.raises(ValueError, match="usage='batch'"):
        default_batch_limits("batch", "gpu", 80 * GIB)


def test_total_memory_from_pool_fraction(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.900")
    assert device_total_memory({"bytes_limit": int(0.9 * 141 * GIB)}) == pytest.approx(141 * GIB, rel=1e-6)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "bogus")  # JAX's own default then
    assert device_total_memory({"bytes_limit": 75 * GIB}) == 100 * GIB
    assert device_total_memory({}) is None
    assert device_total_memory(None) is None


def _engine(folder, cache, **kw):
    return LLM(folder, dtype="float32", max_model_len=128, compilation_cache_dir=cache, **kw).llm_engine


def test_unset_limits_take_the_platform_default(tiny_llama_dir, jax_cache_dir):
    info = _engine(tiny_llama_dir, jax_cache_dir).startup_info
    assert (info["max_num_seqs"], info["max_num_batched_tokens"]) == HOST_LIMITS  # these tests run on the CPU


def test_given_limits_are_kept(tiny_llama_dir, jax_cache_dir):
    eng = _engine(tiny_llama_dir, jax_cache_dir, max_num_seqs=96, max_num_batched_tokens=1024)
    assert (eng.startup_info["max_num_seqs"], eng.startup_info["max_num_batched_tokens"]) == (96, 1024)
    assert eng.scheduler.config.max_num_seqs == 96
    assert eng.runner.plan.token_buckets[-1] == 1024


def test_step_memory_covers_the_widest_sampler(tiny_llama_dir, jax_cache_dir):
    runner = _engine(tiny_llama_dir, jax_cache_dir, max_num_seqs=64, max_num_batched_tokens=64).runner
    need = runner.largest_step_temp_bytes()
    s = runner.plan.seqs_for(runner.plan.token_buckets[-1])
    widest = SamplerFlags(False, True, True, MAX_LOGPROBS)
    smd = runner.compiler.empty_sampling_metadata(s, widest)
    # Its arguments alone: the [S, V] logits and the [S, history] penalty history, at least.
    floor = s * runner.vocab_size * 4 + sum(x.nbytes for x in jax.tree.leaves(smd))
    assert need >= floor
