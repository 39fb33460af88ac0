"""The command line: flags generated from EngineArgs and ServerArgs (vLLM's names, every field a flag, every
old flag still accepted), errors that name the flag, the entry points, and the start-up log; nothing is
loaded (the engine is a stand-in)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import platform
import subprocess
import sys
import types

import pytest

from jaxllm.engine_args import EngineArgs, Platform
from jaxllm.server import cli
from jaxllm.server.args import ServerArgs


def engine_args(argv: list[str], **kw) -> EngineArgs:
    return cli.parse_args(argv, **kw).engine


def test_defaults_are_the_dataclasses_defaults(monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = cli.parse_args([])
    assert args.engine == EngineArgs() and args.server == ServerArgs()
    assert args.server.port == 8000 and args.server.host is None and args.server.api_key is None
    assert args.engine.model is None  # the embedded model


# One non-default value per field, written as a user would type it. Every field must be here: a field
# added without a flag (or a flag whose value does not reach its field) fails test_every_field_is_a_flag.
ENGINE_FLAGS = {
    "model": (["--model", "my/model"], "my/model"),
    "tokenizer": (["--tokenizer", "tok"], "tok"),
    "revision": (["--revision", "v2"], "v2"),
    "tokenizer_revision": (["--tokenizer-revision", "v3"], "v3"),
    "download_dir": (["--download-dir", "/hub"], "/hub"),
    "tokenizer_mode": (["--tokenizer-mode", "slow"], "slow"),
    "trust_remote_code": (["--trust-remote-code"], True),
    "code_revision": (["--code-revision", "c1"], "c1"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "quantization": (["-q", "gguf"], "gguf"),
    "load_format": (["--load-format", "dummy"], "dummy"),
    "checkpoint_dir": (["--checkpoint-dir", "/ckpt"], "/ckpt"),
    "seed": (["--seed", "3"], 3),
    "max_model_len": (["--max-model-len", "4096"], 4096),
    "generation_config": (["--generation-config", "vllm"], "vllm"),
    "override_generation_config": (
        ["--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}'],
        {"temperature": 0.5, "max_new_tokens": 64},
    ),
    "max_logprobs": (["--max-logprobs", "5"], 5),
    "block_size": (["--block-size", "32"], 32),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "num_gpu_blocks_override": (["--num-gpu-blocks-override", "100"], 100),
    "swap_space": (["--swap-space", "4"], 4.0),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], "fp8"),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "max_num_seqs": (["--max-num-seqs", "32"], 32),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "8192"], 8192),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], False),
    "scheduling_policy": (["--scheduling-policy", "priority"], "priority"),
    "async_scheduling": (["--no-async-scheduling"], False),
    "speculative_config": (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        {"method": "ngram", "num_speculative_tokens": 3},
    ),
    "max_num_queued_reqs": (["--max-num-queued-reqs", "100"], 100),
    "tensor_parallel_size": (["-tp", "2"], 2),
    "pipeline_parallel_size": (["-pp", "1"], 1),
    "data_parallel_size": (["-dp", "1"], 1),
    "distributed_executor_backend": (["--distributed-executor-backend", "ray"], "ray"),
    "max_parallel_loading_workers": (["--max-parallel-loading-workers", "2"], 2),
    "coordinator_address": (["--coordinator-address", "h:9"], "h:9"),
    "num_processes": (["--num-processes", "2"], 2),
    "process_id": (["--process-id", "1"], 1),
    "attention_backend": (["--attention-backend", "reference"], "reference"),
    "enforce_eager": (["--enforce-eager"], True),
    "compile_ahead": (["--no-compile-ahead"], False),
    "compile_research_ahead": (["--compile-research-ahead"], True),
    "compilation_cache_dir": (["--compilation-cache-dir", ""], ""),
    "executable_cache": (["--executable-cache"], True),
}
SERVER_FLAGS = {
    "host": (["--host", "127.0.0.1"], "127.0.0.1"),
    "port": (["--port", "9000"], 9000),
    "api_key": (["--api-key", "k"], "k"),
    "served_model_name": (["--served-model-name", "alias", "other"], ["alias", "other"]),
    "chat_template": (["--chat-template", "{{ messages }}"], "{{ messages }}"),
    "max_request_body_bytes": (["--max-request-body-bytes", "1024"], 1024),
    "gil_switch_interval_ms": (["--gil-switch-interval-ms", "0.2"], 0.2),
    "uvicorn_log_level": (["--uvicorn-log-level", "debug"], "debug"),
    "disable_log_stats": (["--disable-log-stats"], True),
    "enable_auto_tool_choice": (["--enable-auto-tool-choice"], True),
    "tool_call_parser": (["--tool-call-parser", "hermes"], "hermes"),
    "reasoning_parser": (["--reasoning-parser", "deepseek_r1"], "deepseek_r1"),
    "enable_log_requests": (["--enable-log-requests"], True),
    "disable_log_requests": (["--disable-log-requests"], True),
    "max_log_len": (["--max-log-len", "40"], 40),
    "disable_uvicorn_access_log": (["--disable-uvicorn-access-log"], True),
    "shutdown_timeout": (["--shutdown-timeout", "12.5"], 12.5),
    "root_path": (["--root-path", "/llm"], "/llm"),
    "allowed_origins": (["--allowed-origins", '["https://a.example"]'], ["https://a.example"]),
    "allowed_methods": (["--allowed-methods", '["GET", "POST"]'], ["GET", "POST"]),
    "allowed_headers": (["--allowed-headers", '["Authorization"]'], ["Authorization"]),
    "allow_credentials": (["--allow-credentials"], True),
    "enable_request_id_headers": (["--enable-request-id-headers"], True),
    "disable_fastapi_docs": (["--disable-fastapi-docs"], True),
    "ssl_keyfile": (["--ssl-keyfile", "/k.pem"], "/k.pem"),
    "ssl_certfile": (["--ssl-certfile", "/c.pem"], "/c.pem"),
    "enable_research_api": (["--enable-research-api"], True),
    "max_research_capture_bytes": (["--max-research-capture-bytes", "4096"], 4096),
    "max_research_sites": (["--max-research-sites", "3"], 3),
    "max_research_steers": (["--max-research-steers", "2"], 2),
}


def test_every_field_is_a_flag():
    assert set(ENGINE_FLAGS) == {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(SERVER_FLAGS) == {f.name for f in dataclasses.fields(ServerArgs)}
    argv = [a for flags, _ in [*ENGINE_FLAGS.values(), *SERVER_FLAGS.values()] for a in flags]
    args = cli.parse_args(argv, positional_model=False)
    assert args.engine == EngineArgs(**{k: v for k, (_, v) in ENGINE_FLAGS.items()})
    assert args.server == ServerArgs(**{k: v for k, (_, v) in SERVER_FLAGS.items()})


def test_research_flags_are_the_limits_requests_are_held_to():
    from jaxllm.server.research import ResearchLimits

    names = ("enable_research_api", "max_research_capture_bytes", "max_research_sites", "max_research_steers")
    argv = [a for name in names for a in SERVER_FLAGS[name][0]]
    server = cli.parse_args(argv, positional_model=False).server
    assert server.research_limits() == ResearchLimits(True, 4096, 3, 2)
    assert cli.parse_args([], positional_model=False).server.research_limits() == ResearchLimits()
    assert not ResearchLimits().enabled


def test_the_flags_of_earlier_versions_still_parse():
    """The long forms, positional model and on/off pairs that scripts already use."""
    e = engine_args(
        [
            "my/model",
            "--tensor-parallel-size",
            "2",
            "--quantization",
            "gguf",
            "--enable-prefix-caching",
            "--enable-chunked-prefill",
            "--async-scheduling",
            "--no-executable-cache",
        ]  # fmt: skip
    )
    assert e.model == "my/model" and e.tensor_parallel_size == 2 and e.quantization == "gguf"
    assert e.enable_prefix_caching and e.enable_chunked_prefill and e.async_scheduling
    assert e.executable_cache is False
    assert engine_args(["my/model"]).executable_cache is None  # unset: the platform decides


def test_no_chunked_prefill_fits_a_whole_prompt():
    """The one fallback: without chunked prefill and without --max-num-batched-tokens, a step holds a
    whole prompt (the platform's budget when larger)."""
    cpu, h100 = Platform("cpu", "cpu"), Platform("gpu", "NVIDIA H100 80GB HBM3", 80 * 2**30)
    e = engine_args(["--no-enable-chunked-prefill", "--max-model-len", "8192"])
    assert e.create_engine_config(h100, 131072, "server").scheduler.max_num_batched_tokens == 8192
    assert e.create_engine_config(cpu, 131072, "server").scheduler.max_num_batched_tokens == 8192
    small = engine_args(["--no-enable-chunked-prefill", "--max-model-len", "1024"])
    assert small.create_engine_config(h100, 131072, "offline").scheduler.max_num_batched_tokens == 16384


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.parse_args([]).server.api_key == "from-env"
    assert cli.parse_args(["--api-key", "flag"]).server.api_key == "flag"


def test_chat_template_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert cli.parse_args(["--chat-template", str(f)]).server.chat_template == "{{ messages[0]['content'] }}"
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert cli.parse_args(["--chat-template", inline]).server.chat_template == inline
    with pytest.raises(SystemExit):
        cli.parse_args(["--chat-template", "/no/such/file.jinja"])


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--block-size", "7"], "--block-size"),
        (["--dtype", "int3"], "--dtype"),
        (["--port", "x"], "--port"),
        (["--port", "70000"], "--port"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--gil-switch-interval-ms", "0"], "--gil-switch-interval-ms"),
        (["--gil-switch-interval-ms", "-1"], "--gil-switch-interval-ms"),
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
        (["--process-id", "2", "--num-processes", "2"], "--process-id"),
        (["--enforce-eager", "--compile-ahead"], "--compile-ahead"),
        (["--generation-config", "/no/such/folder"], "--generation-config"),
        (["--override-generation-config", "{temperature: 1}"], "--override-generation-config"),
        (["--override-generation-config", "[1, 2]"], "--override-generation-config"),
        (["--override-generation-config", '{"temp": 0.5}'], "--override-generation-config"),
        (["--override-generation-config", '{"top_p": 0}'], "--override-generation-config"),
        (["--max-logprobs", "21"], "--max-logprobs"),  # the sampler computes 20 wide
        (["--max-logprobs", "-1"], "--max-logprobs"),
    ],
)
def test_bad_values_exit_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_a_bad_combination_is_rejected_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(
            ["--no-enable-chunked-prefill", "--max-model-len", "4096", "--max-num-batched-tokens", "1024"]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert (
        "--max-num-batched-tokens" in err
        and "--max-model-len" in err
        and "--no-enable-chunked-prefill" in err
    )


def test_api_server_module_takes_model_flag():
    assert engine_args(["--model", "m"], positional_model=False).model == "m"
    with pytest.raises(SystemExit):
        cli.parse_args(["m"], positional_model=False)
    with pytest.raises(SystemExit):
        cli.parse_args(["a", "--model", "b"])


def test_startup_lines_leave_the_limits_to_the_engine():
    info = {
        "model": "SmolLM2",
        "dtype": "bfloat16",
        "num_gpu_blocks": 1000,
        "block_size": 16,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 512,
        "max_concurrency": 7.8125,
        "compile_time_s": 12.3,
        "load_time_s": 1.5,
    }
    lines = cli.startup_lines(info, "http://0.0.0.0:8000")
    assert lines == [
        "Engine: compile_time_s=12.3, load_time_s=1.5",
        "Serving the OpenAI-compatible API on http://0.0.0.0:8000/v1 (docs: http://0.0.0.0:8000/v1/models, "
        "http://0.0.0.0:8000/health, http://0.0.0.0:8000/metrics)",
    ]


@pytest.fixture
def serve_with_stand_ins(monkeypatch):
    """`jaxllm serve` with the engine and uvicorn.Server.run replaced (the real engine plugs in here): what the
    engine was built with, the GIL switch interval at that moment, and what uvicorn was configured with land in
    the returned dict. The interpreter's switch interval is put back afterwards."""
    from tests.server.mock_engine import MockAsyncEngine

    seen = {}

    class Engine(MockAsyncEngine):
        @classmethod
        def from_engine_args(cls, args, *, served_model_name=None):
            seen["args"], seen["served_model_name"] = args, served_model_name
            seen["interval"] = sys.getswitchinterval()
            return super().from_engine_args(args, served_model_name=served_model_name)

    fake = types.ModuleType("jaxllm.engine.async_engine")
    fake.AsyncLLMEngine = Engine
    monkeypatch.setitem(sys.modules, "jaxllm.engine.async_engine", fake)
    import uvicorn

    def run(server, sockets=None):
        c = server.config
        seen.update(app=c.app, host=c.host, port=c.port, log_level=c.log_level)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    before = sys.getswitchinterval()
    yield seen
    sys.setswitchinterval(before)


def test_serve_sets_the_gil_switch_interval(serve_with_stand_ins):
    """The flag's value reaches sys.setswitchinterval before the engine starts its thread."""
    sys.setswitchinterval(0.005)
    cli.main(["serve", "--gil-switch-interval-ms", "0.7"])
    assert serve_with_stand_ins["interval"] == pytest.approx(0.0007)


def test_serve_builds_engine_and_runs_uvicorn(serve_with_stand_ins, caplog):
    """`jaxllm serve` end to end with the engine and uvicorn.Server.run replaced."""
    seen = serve_with_stand_ins
    argv = ["serve", "--max-model-len", "128", "--port", "9123", "--served-model-name", "x", "--api-key", "k"]
    with caplog.at_level(logging.INFO, logger="jaxllm.server"):
        cli.main(argv + ["--max-logprobs", "7"])
    assert seen["args"] == EngineArgs(max_model_len=128, max_logprobs=7) and seen["port"] == 9123
    assert seen["served_model_name"] == "x"
    assert sys.getswitchinterval() == pytest.approx(cli.DEFAULT_GIL_SWITCH_INTERVAL_MS / 1000)
    state = seen["app"].state.server
    assert state.served_names == ["x"] and state.api_key == "k" and state.max_logprobs == 7
    assert (
        "http://0.0.0.0:9123" in caplog.text
        and "engine arguments given: {'max_model_len': 128, 'max_logprobs': 7}" in caplog.text
    )
    assert "GIL switch interval 0.05 ms" in caplog.text
    # `jaxllm doctor`'s summary, once the engine is up: the versions this process runs with.
    (env_line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Environment: ")]
    jax_v, jaxlib_v = importlib.metadata.version("jax"), importlib.metadata.version("jaxlib")
    assert f"Python {platform.python_version()}, jax {jax_v}, jaxlib {jaxlib_v}" in env_line
    assert env_line.endswith("(`jaxllm doctor` for details)")


def test_jaxllm_doctor_is_a_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--help"])
    assert e.value.code == 0 and "--json" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--no-such-flag"])
    assert e.value.code == 2


def test_http_runtime_line_names_what_uvicorn_picks(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    line = cli.http_runtime_line(0.2)
    assert "event loop asyncio" in line and "GIL switch interval 0.2 ms" in line
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert "event loop uvloop, parser httptools" in cli.http_runtime_line(5)


def test_entry_points_help():
    r = subprocess.run(
        [sys.executable, "-m", "jaxllm.entrypoints.openai.api_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    for flag in ("--tensor-parallel-size", "-tp", "--max-request-body-bytes", "--generation-config"):
        assert flag in r.stdout
    with pytest.raises(SystemExit) as e:
        cli.main(["bogus"])
    assert e.value.code == 2


def test_server_never_imports_jax():
    code = (
        "import sys, jaxllm.server.app, jaxllm.server.cli, jaxllm.entrypoints.openai.api_server; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax'))]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
