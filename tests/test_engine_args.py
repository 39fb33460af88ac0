"""EngineArgs -> EngineConfig: every platform default resolved in one place (CPU and GPU, offline and
server), given values kept as given, bad values and combinations named by their flags; LLM(**kwargs)
takes exactly EngineArgs' fields. No jax, no model: platforms are written out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from jaxllm.config import GenerationDefaults
from jaxllm.engine_args import (
    CPU_MAX_MODEL_LEN,
    ENGINE_ARG_NAMES,
    EngineArgs,
    Platform,
    engine_args_from_kwargs,
)

GIB = 2**30
CPU = Platform("cpu", "cpu", None, 1, "reference", False)
H100 = Platform("gpu", "NVIDIA H100 80GB HBM3", 80 * GIB, 1, "pallas-hopper", True)
L4 = Platform("gpu", "NVIDIA L4", 24 * GIB, 1, "pallas", True)
MODEL_LEN = 131072  # the model's max_position_embeddings


def resolve(platform: Platform, usage: str, **kw):
    return EngineArgs(**kw).create_engine_config(platform, MODEL_LEN, usage)


@pytest.mark.parametrize(
    "platform, usage, seqs, tokens, max_model_len, ahead, executables, growth, backend",
    [
        (CPU, "offline", 64, 512, CPU_MAX_MODEL_LEN, False, False, 4, "reference"),
        (CPU, "server", 64, 512, CPU_MAX_MODEL_LEN, False, False, 4, "reference"),
        (H100, "offline", 1024, 16384, MODEL_LEN, True, False, 2, "pallas-hopper"),
        (H100, "server", 1024, 8192, MODEL_LEN, True, True, 2, "pallas-hopper"),
        (L4, "server", 256, 2048, MODEL_LEN, True, True, 2, "pallas"),
    ],
)
def test_platform_defaults(platform, usage, seqs, tokens, max_model_len, ahead, executables, growth, backend):
    c = resolve(platform, usage)
    s, r = c.scheduler, c.runner
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (seqs, tokens, max_model_len)
    assert (r.compile_ahead, r.executable_cache, r.bucket_growth, r.attention_backend) == (
        ahead,
        executables,
        growth,
        backend,
    )
    assert c.usage == usage and s.enable_chunked_prefill and c.cache.block_size == 16


def test_given_values_are_kept_on_every_platform():
    kw = dict(
        max_num_seqs=96,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        compile_ahead=False,
        executable_cache=False,
        attention_backend="reference",
    )
    for platform in (CPU, H100):
        c = resolve(platform, "server", **kw)
        assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (96, 1024)
        assert c.scheduler.max_model_len == 4096  # given: no CPU cap
        assert not c.runner.compile_ahead and not c.runner.executable_cache
        assert c.runner.attention_backend == "reference"
    assert resolve(CPU, "offline", max_logprobs=5).max_logprobs == 5
    assert resolve(CPU, "offline").max_logprobs == 20  # vLLM's default


def test_enforce_eager_and_unsupported_executable_cache():
    assert not resolve(H100, "server", enforce_eager=True).runner.compile_ahead
    assert not resolve(CPU, "offline", executable_cache=True).runner.executable_cache  # CPU: not kept
    assert not resolve(H100, "server", compilation_cache_dir="").runner.executable_cache  # nowhere to keep
    assert resolve(CPU, "offline", compile_ahead=True).runner.compile_ahead


def test_compilation_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "env"))
    assert resolve(CPU, "offline").runner.compilation_cache_dir == str(tmp_path / "env")
    assert resolve(CPU, "offline", compilation_cache_dir="/x").runner.compilation_cache_dir == "/x"
    assert resolve(CPU, "offline", compilation_cache_dir="").runner.compilation_cache_dir is None


def test_chunked_prefill_fallback_exists_once():
    """Off, with no token budget given: a whole prompt per step, or the platform's budget when larger."""
    c = resolve(H100, "server", enable_chunked_prefill=False)
    assert c.scheduler.max_num_batched_tokens == MODEL_LEN
    c = resolve(H100, "offline", enable_chunked_prefill=False, max_model_len=4096)
    assert c.scheduler.max_num_batched_tokens == 16384
    c = resolve(CPU, "offline", enable_chunked_prefill=False)
    assert c.scheduler.max_num_batched_tokens == CPU_MAX_MODEL_LEN


def test_combinations_that_need_the_model_are_rejected_at_resolution():
    with pytest.raises(ValueError, match=r"max_model_len=200000 \(--max-model-len\) exceeds"):
        resolve(H100, "server", max_model_len=200_000)
    # Tokens given, max_model_len left to the model's 131072: only known once the model is read.
    args = EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=8192)
    with pytest.raises(ValueError) as e:
        args.create_engine_config(H100, MODEL_LEN, "server")
    for name in (
        "--max-num-batched-tokens",
        "--max-model-len",
        "--no-enable-chunked-prefill",
        "8192",
        "131072",
    ):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="usage='batch'"):
        EngineArgs().create_engine_config(CPU, MODEL_LEN, "batch")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_num_seqs": 0}, r"max_num_seqs=0 \(--max-num-seqs\) must be >= 1"),
        ({"max_num_seqs": "8"}, r"max_num_seqs='8' \(--max-num-seqs\) must be an int"),
        ({"enable_prefix_caching": 1}, r"\(--enable-prefix-caching\) must be a bool"),
        ({"block_size": 7}, r"block_size=7 \(--block-size\) must be one of \[8, 16, 32, 64, 128\]"),
        ({"gpu_memory_utilization": 0.0}, r"\(--gpu-memory-utilization\) must be > 0.0"),
        ({"quantization": "bitsandbytes"}, r"quantization='bitsandbytes' \(-.*must be one of \['fp8'"),
        ({"dtype": None}, r"dtype=None \(--dtype\) must be given"),
        ({"process_id": 1}, r"process_id=1 \(--process-id\) must be in \[0, num_processes=1\)"),
        ({"enforce_eager": True, "compile_ahead": True}, r"--enforce-eager.*--compile-ahead"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 4096, "max_num_batched_tokens": 1024},
            r"max_num_batched_tokens=1024 \(--max-num-batched-tokens\) is smaller than max_model_len=4096",
        ),
        (
            {"override_generation_config": {"temp": 1}},
            r"--override-generation-config.*unknown keys \['temp'\]",
        ),
        ({"override_generation_config": {"top_p": 2.0}}, r"--override-generation-config.*top_p=2.0"),
        ({"generation_config": "/no/such/folder"}, r"--generation-config"),
        ({"max_logprobs": 21}, r"max_logprobs=21 \(--max-logprobs\) must be <= 20"),
        (
            {"kv_cache_dtype": "fp8_e4m3fn"},
            r"kv_cache_dtype='fp8_e4m3fn' \(--kv-cache-dtype\) must be one of",
        ),
    ],
)
def test_bad_values_name_the_field_and_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2", "auto", "bfloat16"])
def test_kv_cache_dtype_takes_vllms_values(value):
    """vLLM's --kv-cache-dtype values for 8-bit caches ("fp8" is e4m3) reach the cache config as given."""
    config = EngineArgs(kv_cache_dtype=value).create_engine_config(CPU, MODEL_LEN, "offline")
    assert config.cache.kv_cache_dtype == value


def test_generation_defaults_pass_through():
    g = GenerationDefaults({"temperature": 0.2}, "card")
    assert EngineArgs().create_engine_config(CPU, 512, "offline", g).generation == g
    assert EngineArgs().create_engine_config(CPU, 512, "offline").generation == GenerationDefaults()


# Every keyword LLM(...) took before EngineArgs existed.
EARLIER_LLM_KEYWORDS = (
    "tokenizer tensor_parallel_size coordinator_address num_processes process_id dtype quantization seed "
    "max_model_len gpu_memory_utilization swap_space enable_prefix_caching enable_chunked_prefill "
    "max_num_batched_tokens max_num_seqs block_size num_gpu_blocks_override kv_cache_dtype load_format "
    "enforce_eager compile_ahead attention_backend checkpoint_dir compilation_cache_dir executable_cache "
    "scheduling_policy async_scheduling"
).split()


def test_llm_keywords_are_the_fields():
    assert set(EARLIER_LLM_KEYWORDS) <= set(ENGINE_ARG_NAMES)
    args = engine_args_from_kwargs("LLM()", "m", {"max_num_seqs": 8, "swap_space": 1})
    assert args == EngineArgs(model="m", max_num_seqs=8, swap_space=1)
    with pytest.raises(
        TypeError, match=r"LLM\(\) got unexpected keyword argument\(s\) 'max_num_seq' \(did you"
    ):
        engine_args_from_kwargs("LLM()", None, {"max_num_seq": 8})
    with pytest.raises(TypeError, match="'bogus'"):
        engine_args_from_kwargs("LLM()", None, {"bogus": 1, "seed": 2})


def test_llm_rejects_an_unknown_keyword_before_loading():
    from jaxllm import LLM

    with pytest.raises(TypeError, match="'max_num_seq' .did you mean 'max_num_seqs'"):
        LLM("/no/such/model", max_num_seq=8)


def test_non_default_lists_what_was_given():
    assert EngineArgs().non_default() == {}
    assert EngineArgs(max_num_seqs=8, dtype="float32").non_default() == {
        "max_num_seqs": 8,
        "dtype": "float32",
    }
    assert {f.name for f in dataclasses.fields(EngineArgs)} == set(ENGINE_ARG_NAMES)


def test_speculative_config_takes_vllms_json():
    from jaxllm.config import SpeculativeConfig

    spec = resolve(
        CPU, "server", speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    ).speculative
    assert spec == SpeculativeConfig("ngram", 3, 5, 5, None)  # both lookup sizes default to 5
    one = {"num_speculative_tokens": 2, "prompt_lookup_max": 4}
    assert resolve(CPU, "offline", speculative_config=one).speculative.prompt_lookup_min == 4
    assert resolve(CPU, "offline").speculative is None
    # A model without a method is a draft model, as in vLLM.
    draft = {"model": "/models/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}
    spec = resolve(CPU, "offline", speculative_config=draft).speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/models/draft", 3)


@pytest.mark.parametrize(
    "value, message",
    [
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            r"speculative_config.method='eagle': served are prompt lookup",
        ),
        (
            {"method": "lookahead", "num_speculative_tokens": 2},
            r"speculative_config.method='lookahead' must be",
        ),
        ({"method": "ngram"}, r"speculative_config.num_speculative_tokens is required"),
        (
            {"num_speculative_tokens": 0},
            r"speculative_config.num_speculative_tokens=0 must be an integer >= 1",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min=4 must be <=",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
            r"speculative_config.model applies to",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model is required"),
        (
            {"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            r"speculative_config.prompt_lookup_max applies to method 'ngram'",
        ),
        (
            {"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            r"speculative_config.draft_tensor_parallel_size=2: the draft model runs on one device",
        ),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, r"unknown keys \['draft_model'\]"),
    ],
)
def test_bad_speculative_config_names_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)
