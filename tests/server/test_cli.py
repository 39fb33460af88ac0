"""Flag -> EngineConfig mapping (vLLM's names), the entry points, and the startup log; nothing is loaded."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

from jaxllm.config import EngineConfig
from jaxllm.server import cli


def config(argv: list[str], **kw) -> EngineConfig:
    return cli.engine_config_from_args(cli.parse_args(argv, **kw))


def test_defaults_are_engine_defaults(monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    args = cli.parse_args([])
    assert args.port == 8000 and args.host is None and args.api_key is None
    c = cli.engine_config_from_args(args)
    assert c == EngineConfig()
    assert c.model.model is None  # the embedded model


def test_every_flag_maps(tmp_path):
    c = config(
        [
            "my/model",
            "--tensor-parallel-size",
            "2",
            "--max-model-len",
            "4096",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-seqs",
            "32",
            "--max-num-batched-tokens",
            "8192",
            "--swap-space",
            "4",
            "--enforce-eager",
            "--quantization",
            "gguf",
            "--dtype",
            "bfloat16",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--served-model-name",
            "alias",
            "other",
            "--seed",
            "3",
            "--block-size",
            "32",
            "--kv-cache-dtype",
            "float16",
            "--load-format",
            "dummy",
            "--attention-backend",
            "reference",
            "--num-gpu-blocks-override",
            "100",
            "--tokenizer",
            "tok",
        ]
    )
    assert c.model.model == "my/model" and c.model.tokenizer == "tok"
    assert c.parallel.tensor_parallel_size == 2
    assert c.model.max_model_len == 4096 and c.scheduler.max_model_len == 4096
    assert c.cache.gpu_memory_utilization == 0.5 and c.cache.swap_space_gib == 4.0
    assert c.scheduler.max_num_seqs == 32 and c.scheduler.max_num_batched_tokens == 8192
    assert c.runner.enforce_eager and c.runner.attention_backend == "reference"
    assert c.model.quantization == "gguf" and c.model.dtype == "bfloat16" and c.model.seed == 3
    assert not c.cache.enable_prefix_caching and not c.scheduler.enable_chunked_prefill
    assert c.model.served_model_name == "alias"
    assert (
        c.cache.block_size == 32
        and c.cache.kv_cache_dtype == "float16"
        and c.cache.num_gpu_blocks_override == 100
    )
    assert c.model.load_format == "dummy"
    on = config(["--enable-prefix-caching", "--enable-chunked-prefill"])
    assert on.cache.enable_prefix_caching and on.scheduler.enable_chunked_prefill


def test_no_chunked_prefill_fits_a_whole_prompt():
    c = config(["--no-enable-chunked-prefill", "--max-model-len", "8192"])
    assert c.scheduler.max_num_batched_tokens == 8192


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.parse_args([]).api_key == "from-env"
    assert cli.parse_args(["--api-key", "flag"]).api_key == "flag"


def test_chat_template_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert cli.parse_args(["--chat-template", str(f)]).chat_template_text == "{{ messages[0]['content'] }}"
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = cli.parse_args(["--chat-template", inline])
    assert (
        args.chat_template_text == inline and cli.engine_config_from_args(args).model.chat_template == inline
    )
    with pytest.raises(SystemExit):
        cli.parse_args(["--chat-template", "/no/such/file.jinja"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-memory-utilization", "1.5"],
        ["--block-size", "7"],
        ["--dtype", "int3"],
        ["--port", "x"],
        ["--max-num-seqs", "0"],
        ["--gil-switch-interval-ms", "0"],
        ["--gil-switch-interval-ms", "-1"],
    ],
)
def test_bad_values_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2


def test_api_server_module_takes_model_flag():
    c = config(["--model", "m"], positional_model=False)
    assert c.model.model == "m"
    with pytest.raises(SystemExit):
        cli.parse_args(["m"], positional_model=False)


def test_startup_lines():
    lines = cli.startup_lines(
        {
            "model": "SmolLM2",
            "dtype": "bfloat16",
            "num_gpu_blocks": 1000,
            "block_size": 16,
            "max_concurrency": 7.8125,
            "compile_time_s": 12.3,
        },
        2048,
        "http://0.0.0.0:8000",
    )
    text = "\n".join(lines)
    for part in [
        "SmolLM2",
        "bfloat16",
        "# GPU blocks: 1000",
        "Maximum concurrency for 2048 tokens per request: 7.81x",
        "12.30 s",
        "http://0.0.0.0:8000",
    ]:
        assert part in text


@pytest.fixture
def serve_with_stand_ins(monkeypatch):
    """`jaxllm serve` with the engine and uvicorn.run replaced (the real engine plugs in here): what the
    engine was built with, the GIL switch interval at that moment, and what uvicorn.run was given land in
    the returned dict. The interpreter's switch interval is put back afterwards."""
    from tests.server.mock_engine import MockAsyncEngine

    seen = {}

    class Engine(MockAsyncEngine):
        @classmethod
        def from_config(cls, config, *, user_set=frozenset()):
            seen["config"], seen["user_set"] = config, user_set
            seen["interval"] = sys.getswitchinterval()
            return super().from_config(config)

    fake = types.ModuleType("jaxllm.engine.async_engine")
    fake.AsyncLLMEngine = Engine
    monkeypatch.setitem(sys.modules, "jaxllm.engine.async_engine", fake)
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    before = sys.getswitchinterval()
    yield seen
    sys.setswitchinterval(before)


def test_serve_sets_the_gil_switch_interval(serve_with_stand_ins):
    """The flag's value reaches sys.setswitchinterval before the engine starts its thread."""
    sys.setswitchinterval(0.005)
    cli.main(["serve", "--gil-switch-interval-ms", "0.7"])
    assert serve_with_stand_ins["interval"] == pytest.approx(0.0007)


def test_serve_builds_engine_and_runs_uvicorn(serve_with_stand_ins, caplog):
    """`jaxllm serve` end to end with the engine and uvicorn.run replaced."""
    seen = serve_with_stand_ins
    with caplog.at_level(logging.INFO, logger="jaxllm.server"):
        cli.main(
            [
                "serve",
                "--max-model-len",
                "128",
                "--port",
                "9123",
                "--served-model-name",
                "x",
                "--api-key",
                "k",
            ]
        )
    assert seen["config"].model.max_model_len == 128 and seen["port"] == 9123
    assert sys.getswitchinterval() == pytest.approx(cli.DEFAULT_GIL_SWITCH_INTERVAL_MS / 1000)
    assert seen["user_set"] == frozenset({"max_model_len"})
    state = seen["app"].state.server
    assert state.served_names == ["x"] and state.api_key == "k"
    assert "http://0.0.0.0:9123" in caplog.text and "Maximum concurrency" in caplog.text
    assert "GIL switch interval 0.05 ms" in caplog.text


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
    assert (
        r.returncode == 0 and "--tensor-parallel-size" in r.stdout and "--max-request-body-bytes" in r.stdout
    )
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


def test_executable_cache_flag():
    """Unset, the engine decides (on for the server on a GPU); the flags force it either way."""
    assert config(["my/model"]).runner.executable_cache is None
    assert config(["my/model", "--executable-cache"]).runner.executable_cache is True
    assert config(["my/model", "--no-executable-cache"]).runner.executable_cache is False
