"""The engine's start-up log on the CPU: it names the device, states each limit once with the values the
engine runs with (scheduler, runner and KV cache alike), says "KV cache blocks" and no GPU word, and
prints only the resolved configuration."""

from __future__ import annotations

import logging
import re

import pytest

from jaxllm import LLM


@pytest.fixture(scope="module")
def started(jax_cache_dir):
    """A tiny random-weight engine with every limit left to the platform, and the records it logged."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, log = Keep(level=logging.INFO), logging.getLogger("jaxllm")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        llm = LLM("tiny-llama", load_format="dummy", compilation_cache_dir=jax_cache_dir)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return llm.llm_engine, [r.getMessage() for r in records]


def _pairs(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=([^,;()\s]+)", line))


def test_device_and_no_gpu_words(started):
    engine, lines = started
    assert "device: cpu x1 (jax platform cpu)" in lines
    assert engine.startup_info["device"] == "cpu"
    assert not [ln for ln in lines if "gpu" in ln.lower()]
    assert sum("KV cache blocks" in ln for ln in lines) == 1


def test_limits_once_and_as_run(started):
    engine, lines = started
    sched = engine.scheduler.config
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "KV cache blocks"):
        assert sum(f"{name}=" in ln for ln in lines) == 1, name
    (limits,) = [ln for ln in lines if ln.startswith("limits: ")]
    got = _pairs(limits)
    # tiny-llama's own context (512) under the CPU cap, and the CPU's batch limits: not EngineConfig's
    # dataclass defaults (256 / 2048), which a stale log once printed.
    assert (sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens) == (512, 64, 512)
    assert int(got["max_model_len"]) == engine.max_model_len == engine.runner.max_model_len == 512
    assert int(got["max_num_seqs"]) == sched.max_num_seqs
    assert (
        int(got["max_num_batched_tokens"])
        == sched.max_num_batched_tokens
        == engine.runner.plan.token_buckets[-1]
    )
    blocks = int(re.search(r"KV cache blocks=(\d+)", limits).group(1))
    assert blocks == engine.scheduler.num_gpu_blocks == engine.runner.kv_caches[0][0].shape[1]


def test_settings_line_is_the_resolved_config(started):
    engine, lines = started
    (settings,) = [ln for ln in lines if ln.startswith("engine config: ")]
    got, runner, cache = _pairs(settings), engine.config.runner, engine.config.cache
    assert got["attention_backend"] == runner.attention_backend == "reference"  # "auto" resolved
    assert got["compile_ahead"] == str(runner.compile_ahead) == "False"  # None resolved: off on the CPU
    assert got["executable_cache"] == str(runner.executable_cache) == "False"
    assert got["compilation_cache_dir"] == runner.compilation_cache_dir == engine.cache_dir
    assert got["dtype"] == "float32" and got["block_size"] == str(cache.block_size)
    assert "None" not in settings and "auto" not in settings  # nothing left unresolved
    (defaults,) = [ln for ln in lines if ln.startswith("sampling defaults")]
    assert "none, SamplingParams' own apply (a random-weight preset has no generation config)" in defaults
