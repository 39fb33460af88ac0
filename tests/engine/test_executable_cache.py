"""The executable cache (jaxllm/runner/executable_cache.py): a second engine loads every step and sampler
variant the first one compiled, traces nothing, and samples the same tokens as the jit path; a changed
environment or description misses; a damaged entry is compiled again and replaced; a disabled cache
compiles every time and stores nothing."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.runner import executable_cache as ec
from jaxllm.runner.compiler import StepCompiler


def _llm(folder, cache, *, ahead=True, keep=True):
    return LLM(
        folder, dtype="float32", max_model_len=256, compilation_cache_dir=cache, compile_ahead=ahead,
        executable_cache=keep, max_num_seqs=16, max_num_batched_tokens=64,
    )  # fmt: skip


def _greedy(llm):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in (6, 40, 19)]
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    return [o.outputs[0].token_ids for o in llm.generate(None, p, prompt_token_ids=prompts, use_tqdm=False)]


def test_second_start_loads_every_variant(tiny_llama_dir, tmp_path, monkeypatch):
    """On the CPU with JAX's persistent cache off (executables it loaded do not serialize again there;
    the engine keeps executables only on GPUs, where they do: executable_cache.supported)."""
    from jax._src import compilation_cache

    monkeypatch.setattr(ec, "supported", lambda: True)
    monkeypatch.setattr(compilation_cache, "is_cache_used", lambda backend: False)
    cache = str(tmp_path / "xla")
    jit_tokens = _greedy(_llm(tiny_llama_dir, cache, ahead=False, keep=False))

    first = _llm(tiny_llama_dir, cache)
    first.llm_engine.runner.wait_for_background_compiles()
    stored = first.llm_engine.runner.executables.misses
    assert stored > 0 and first.llm_engine.runner.executables.hits == 0
    assert _greedy(first) == jit_tokens
    del first

    lowered = []
    real_lower = StepCompiler._lower_sampler
    monkeypatch.setattr(
        StepCompiler, "_lower_sampler", lambda self, *a: lowered.append(a) or real_lower(self, *a)
    )
    second = _llm(tiny_llama_dir, cache)
    runner = second.llm_engine.runner
    runner.wait_for_background_compiles()
    assert (runner.executables.hits, runner.executables.misses) == (stored, 0)
    assert second.llm_engine.startup_info["executables_loaded"] > 0
    assert (
        not lowered and runner.compiler.model_step_traces() == 0
    )  # nothing traced: every variant was loaded
    assert _greedy(second) == jit_tokens
    assert runner.compiler.sample_jit._cache_size() == 0


def test_key_holds_environment_and_description(tmp_path, monkeypatch):
    cache = ec.ExecutableCache(tmp_path)
    k = cache.key("model_step shape=(8, 8, 8)")
    assert k == cache.key("model_step shape=(8, 8, 8)") != cache.key("model_step shape=(8, 8, 32)")
    monkeypatch.setattr(ec, "source_digest", lambda: "edited source")
    assert ec.ExecutableCache(tmp_path).key("model_step shape=(8, 8, 8)") != k
    monkeypatch.undo()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert ec.ExecutableCache(tmp_path).key("model_step shape=(8, 8, 8)") != k
    x = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    assert ec.describe_args((x,)) != ec.describe_args((jax.ShapeDtypeStruct((4, 2), jnp.bfloat16),))


def _square_sum(x):
    return (x * x).sum(axis=1)


def test_damaged_entry_is_compiled_again_and_replaced(tmp_path, caplog):
    x = jnp.arange(12.0).reshape(3, 4)
    compiles = []

    def compile_fn():
        compiles.append(1)
        return jax.jit(_square_sum).lower(x).compile()

    cache = ec.ExecutableCache(tmp_path)
    np.testing.assert_array_equal(cache.get_or_compile("sq", compile_fn)(x), _square_sum(x))
    (entry,) = list(tmp_path.rglob("*.exe"))
    assert cache.contains("sq") and not cache.contains("other")
    entry.write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        exe = ec.ExecutableCache(tmp_path).get_or_compile("sq", compile_fn)
    assert "did not load; compiling instead" in caplog.text and len(compiles) == 2
    np.testing.assert_array_equal(exe(x), _square_sum(x))
    again = ec.ExecutableCache(tmp_path)
    np.testing.assert_array_equal(again.get_or_compile("sq", compile_fn)(x), _square_sum(x))
    assert (again.hits, len(compiles)) == (1, 2)  # the replaced entry loads
    assert not list(tmp_path.rglob("*.tmp"))


def test_engine_keeps_executables_only_where_supported(tiny_llama_dir, tmp_path):
    """On the CPU the engine keeps none, even when asked."""
    assert not ec.supported()
    llm = _llm(tiny_llama_dir, str(tmp_path / "xla"))
    llm.llm_engine.runner.wait_for_background_compiles()  # no compile threads left for later tests
    assert llm.llm_engine.runner.executables.directory is None
    assert not (tmp_path / "xla" / "executables").exists()


def test_other_environments_folders_are_removed_once_stale(tmp_path):
    """The first store removes other environments' folders untouched for an hour, not fresh ones (a
    server of another version starting beside this one) and not its own."""
    import os
    import time

    old, fresh = tmp_path / "old-source", tmp_path / "other-version-starting"
    for d in (old, fresh):
        d.mkdir()
        (d / "x.exe").write_bytes(b"entry")
    hour_ago = time.time() - ec.STALE_AFTER_S - 60
    os.utime(old, (hour_ago, hour_ago))
    x = jnp.ones((2, 3))
    cache = ec.ExecutableCache(tmp_path)
    cache.get_or_compile("sq", lambda: jax.jit(_square_sum).lower(x).compile())
    assert not old.exists() and fresh.exists() and cache.contains("sq")
    assert cache.directory.parent == tmp_path and len(list(cache.directory.glob("*.exe"))) == 1


def test_disabled_cache_compiles_every_time(tmp_path):
    x = jnp.ones((2, 2))
    compiles = []
    cache = ec.ExecutableCache(None)
    for _ in range(2):
        cache.get_or_compile("sq", lambda: compiles.append(1) or jax.jit(_square_sum).lower(x).compile())
    assert len(compiles) == 2 and not cache.contains("sq") and not list(tmp_path.iterdir())
