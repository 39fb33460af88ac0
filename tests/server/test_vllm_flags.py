"""vLLM's `vllm serve` command lines run unchanged: every flag of the table in docs/configuration.md is
accepted, "no effect" flags log their line, refused values exit naming the flag, and each implemented
deployment flag does what vLLM's does: CORS answers a browser's preflight, X-Request-Id is echoed, the
routes answer under --root-path (and the API key still guards them), several served names all answer,
--config reads a YAML file that the command line overrides, VLLM_API_KEY is the key when JAXLLM_API_KEY
is not set, and prompts reach the log only with --enable-log-requests (cut at --max-log-len)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from jaxllm.engine_args import EngineArgs, flag_name, flags_without_effect
from jaxllm.server import cli
from jaxllm.server.app import build_app
from jaxllm.server.args import ServerArgs
from jaxllm.server.http_options import HTTPOptions
from tests.server.mock_engine import MockAsyncEngine

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "the cat sat on the mat"}], "max_tokens": 3}


# ---- the table ----------------------------------------------------------------------------------------


def vllm_table() -> list[tuple[list[str], str]]:
    """(flags, status) of each row of the table under "## vLLM's command lines"."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = text.split("## vLLM's command lines", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3, row
        table.append((re.findall(r"`(-[-a-z0-9]+)`", cells[0]), cells[2]))
    return table


def sample_argv(flag: str, tmp_path: Path) -> list[str]:
    """The flag with a value other than its default, as a deployment would write it."""
    special = {
        "--model": ["--model", str(tmp_path)],
        "--tokenizer": ["--tokenizer", "org/tokenizer"],
        "--config": ["--config", str(_yaml(tmp_path, "port: 8001\n"))],
        "--root-path": ["--root-path", "/llm"],
        "--chat-template": ["--chat-template", "{{ messages }}"],
        "--generation-config": ["--generation-config", "vllm"],
        "--ssl-keyfile": ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
        "--ssl-certfile": ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
        "--tool-call-parser": ["--tool-call-parser", "hermes"],
        "--enable-auto-tool-choice": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        "--speculative-config": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
    }
    if flag in special:
        return special[flag]
    action = cli.make_arg_parser()._option_string_actions[flag]  # noqa: SLF001
    if action.nargs == 0:  # a boolean: --x / --no-x
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    if action.metavar == "JSON":
        return [flag, '["https://a.example"]']
    if action.nargs == "+":
        return [flag, "a", "b"]
    if action.type is int:
        return [flag, "2"]
    if action.type is float:
        return [flag, "0.5"]
    return [flag, "x"]


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


def test_every_row_of_the_vllm_table_is_accepted(tmp_path, capsys):
    table = vllm_table()
    assert len(table) >= 30
    no_effect_rows = set()
    for flags, status in table:
        kind = next((k for k in ("implemented", "no effect", "refused") if status.startswith(k)), None)
        assert kind is not None, (
            f"{flags}: status must start with implemented / no effect / refused: {status}"
        )
        assert flags, status
        for flag in flags:
            argv = sample_argv(flag, tmp_path)
            if kind == "refused":  # the default is accepted, another value exits naming the flag
                args = cli.parse_args([flag, str(cli.make_arg_parser().get_default(_dest(flag)))])
                with pytest.raises(SystemExit) as e:
                    cli.parse_args(argv)
                assert e.value.code == 2 and flags[0] in capsys.readouterr().err
                continue
            args = cli.parse_args(argv)
            lines = flags_without_effect(args.engine) + flags_without_effect(args.server)
            mentioned = [line for line in lines if line.startswith(flags[0])]
            if kind == "no effect":
                no_effect_rows.add(flags[0])
                assert len(mentioned) == 1 and "has no effect in jaxllm: " in mentioned[0], (flag, lines)
            else:
                assert not mentioned, (flag, lines)
    # ... and every option that says it has no effect has its row.
    marked = {
        flag_name(f.name)
        for cls in (EngineArgs, ServerArgs)
        for f in dataclasses.fields(cls)
        if f.metadata.get("no_effect")
    }
    assert marked <= no_effect_rows, marked - no_effect_rows


def _dest(flag: str) -> str:
    return cli.make_arg_parser()._option_string_actions[flag].dest  # noqa: SLF001


@pytest.mark.parametrize(
    "argv, says",
    [
        (["-pp", "2"], "--pipeline-parallel-size): jaxllm has no pipeline parallelism"),
        (["--data-parallel-size", "4"], "--data-parallel-size): one jaxllm server runs one engine"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode): mistral_common's tokenizer is not supported"),
        (["--root-path", "llm/"], "--root-path) must start with '/'"),
        (["--ssl-keyfile", "k.pem"], "--ssl-certfile) go together"),
        (["--allowed-origins", "https://a.example"], "--allowed-origins: not valid JSON"),
        (
            ["--allowed-origins", '["https://a.example", 1]'],
            "--allowed-origins: must be a JSON list of strings",
        ),
    ],
)
def test_refused_values_name_the_flag_and_why(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_flag_names_with_underscores_as_vllm_takes_them():
    args = cli.parse_args(["m", "--max_model_len", "64", "--served_model_name", "a", "--enable_log_requests"])
    assert args.engine.max_model_len == 64 and args.server.served_model_name == ["a"]
    assert args.server.enable_log_requests
    assert cli.parse_args(["--max_model_len=32"]).engine.max_model_len == 32


# ---- --config -----------------------------------------------------------------------------------------


def test_config_file_gives_flags_the_command_line_overrides(tmp_path):
    path = _yaml(
        tmp_path,
        "model: org/from-file\nport: 8001\nhost: 127.0.0.1\nserved-model-name: [a, b]\nmax_model_len: 1024\n"
        "enable-prefix-caching: false\ntrust-remote-code: true\nallowed-origins: ['https://a.example']\n"
        "override-generation-config: {temperature: 0.5}\nrevision: null\n",
    )
    args = cli.parse_args(["--config", str(path)])
    assert args.engine.model == "org/from-file" and args.engine.max_model_len == 1024
    assert args.engine.enable_prefix_caching is False and args.engine.trust_remote_code is True
    assert args.engine.override_generation_config == {"temperature": 0.5} and args.engine.revision is None
    assert args.server.port == 8001 and args.server.host == "127.0.0.1"
    assert args.server.served_model_name == ["a", "b"] and args.server.allowed_origins == [
        "https://a.example"
    ]
    # The command line wins: a positional model over the file's, a flag over the file's value.
    args = cli.parse_args(["org/cli", "--port", "9000", f"--config={path}", "--enable-prefix-caching"])
    assert args.engine.model == "org/cli" and args.server.port == 9000 and args.engine.enable_prefix_caching
    assert args.server.host == "127.0.0.1"
    api = cli.parse_args(["--config", str(path), "--model", "org/cli"], positional_model=False)
    assert api.engine.model == "org/cli"


@pytest.mark.parametrize(
    "text, says",
    [
        ("portt: 8001\n", "unknown key 'portt' (jaxllm has no flag --portt)"),
        ("[1, 2]\n", "must be a mapping of flag names to values"),
        ("port: [8001\n", "not valid YAML"),
        ("max-model-len: false\n", "'max-model-len' cannot be false"),
    ],
)
def test_a_bad_config_file_exits_naming_it(tmp_path, text, says, capsys):
    path = _yaml(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--config", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--config {path}: " in err and says in err
    with pytest.raises(SystemExit):
        cli.parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "cannot read it" in capsys.readouterr().err


# ---- API keys -----------------------------------------------------------------------------------------


def test_vllm_api_key_beside_jaxllm_api_key(monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert cli.parse_args([]).server.api_key == "from-vllm"
    monkeypatch.setenv(cli.API_KEY_ENV, "from-jaxllm")
    assert cli.parse_args([]).server.api_key == "from-jaxllm"
    assert cli.parse_args(["--api-key", "flag"]).server.api_key == "flag"


def test_vllm_api_key_guards_the_served_app(serve, monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "k-vllm")
    app = serve([])["app"]
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k-vllm"}).status_code == 200


# ---- serve: what reaches the app and uvicorn ---------------------------------------------------------


@pytest.fixture
def serve(monkeypatch):
    """`jaxllm serve ARGV` with the mock engine and uvicorn.Server.run replaced: returns what uvicorn was
    configured with."""
    import sys
    import types

    import uvicorn

    fake = types.ModuleType("jaxllm.engine.async_engine")
    fake.AsyncLLMEngine = MockAsyncEngine
    monkeypatch.setitem(sys.modules, "jaxllm.engine.async_engine", fake)
    seen: dict = {}

    def run(server, sockets=None):
        c = server.config
        seen.update(
            app=c.app, access_log=c.access_log, ssl_keyfile=c.ssl_keyfile, ssl_certfile=c.ssl_certfile
        )

    monkeypatch.setattr(uvicorn.Server, "run", run)
    before = sys.getswitchinterval()

    def run(argv: list[str]) -> dict:
        cli.main(["serve", *argv])
        return seen

    yield run
    sys.setswitchinterval(before)


def test_several_served_names_all_answer(serve):
    app = serve(["--served-model-name", "llama", "default"])["app"]
    with TestClient(app) as c:
        listed = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert listed == ["llama", "default"]
        for name in listed:
            r = c.post("/v1/chat/completions", json={**CHAT, "model": name})
            assert r.status_code == 200 and r.json()["model"] == "llama"  # the first name, as vLLM reports
        assert c.post("/v1/chat/completions", json={**CHAT, "model": "other"}).status_code == 404


def test_uvicorn_options_and_no_effect_lines(serve, caplog):
    with caplog.at_level(logging.INFO):
        seen = serve(
            ["--disable-uvicorn-access-log", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
             "--trust-remote-code", "--distributed-executor-backend", "mp", "--tokenizer-mode", "slow"]
        )  # fmt: skip
    assert seen["access_log"] is False and seen["ssl_keyfile"] == "k.pem" and seen["ssl_certfile"] == "c.pem"
    assert serve([])["access_log"] is True
    # The mock engine stands in for the engine builder, which logs the engine's no-effect flags itself.
    lines = flags_without_effect(cli.parse_args(["--trust-remote-code"]).engine)
    assert lines == [
        "--trust-remote-code has no effect in jaxllm: jaxllm runs its own implementation of each "
        "architecture, never a checkpoint's code"
    ]


def test_disable_fastapi_docs_drops_openapi(serve):
    with TestClient(serve([])["app"]) as c:
        assert c.get("/openapi.json").status_code == 200
    with TestClient(serve(["--disable-fastapi-docs"])["app"]) as c:
        assert c.get("/openapi.json").status_code == 404


# ---- CORS, request ids, root path ----------------------------------------------------------------------


def app_with(http: HTTPOptions, **kw) -> TestClient:
    return TestClient(build_app(MockAsyncEngine(), http=http, disconnect_poll_s=0.05, **kw))


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_by_default_allows_every_origin_as_vllm():
    with app_with(HTTPOptions()) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": "https://any.example", **PREFLIGHT})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": "https://any.example"})
        assert r.headers["access-control-allow-origin"] == "*"


def test_cors_flags_restrict_origins_methods_headers():
    args = cli.parse_args(
        ["--allowed-origins", '["https://app.example"]', "--allowed-methods", '["POST"]',
         "--allowed-headers", '["Authorization", "Content-Type"]', "--allow-credentials", "--api-key", "k"]
    ).server  # fmt: skip
    with app_with(args.http_options(), api_key=args.api_key) as c:
        ok = c.options("/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert ok.headers["access-control-allow-methods"] == "POST"
        other = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        put = c.options(
            "/v1/chat/completions",
            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "PUT"},
        )
        assert put.status_code == 400
        # A refused key still carries the CORS headers, so the browser's page can read the 401.
        r = c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_request_id_headers():
    with app_with(HTTPOptions(enable_request_id_headers=True)) as c:
        r = c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            new_id = s.headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", new_id) and "[DONE]" in "".join(s.iter_text())
        assert c.get("/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    with app_with(HTTPOptions()) as c:
        assert (
            "x-request-id"
            not in c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "t"}).headers
        )


def test_root_path_serves_under_the_proxy_prefix():
    with app_with(HTTPOptions(root_path="/llm"), api_key="k") as c:
        auth = {"Authorization": "Bearer k"}
        for path in ("/llm/v1/models", "/v1/models"):  # a proxy that passes the prefix on, or strips it
            assert c.get(path, headers=auth).status_code == 200, path
            assert c.get(path).status_code == 401, path  # the prefix does not slip past the key
        assert c.post("/llm/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
        assert c.get("/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
        assert c.get("/llm/health").status_code == 200
    with app_with(HTTPOptions()) as c:
        assert "servers" not in c.get("/openapi.json").json()
        assert c.get("/llm/v1/models").status_code == 404


def test_http_metrics_count_a_prefixed_request_under_its_route():
    """Behind --root-path a request reaches its route with or without the prefix, and is counted there."""
    from tests.server.prom_text import value

    with app_with(HTTPOptions(root_path="/llm")) as c:
        for path in ("/llm/v1/models", "/v1/models"):
            assert c.get(path).status_code == 200, path
        text = c.get("/metrics").text
    assert value(text, "http_requests_total", method="GET", status="2xx", handler="/v1/models") == 2


# ---- request logging ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, logged",
    [
        ([], False),
        (["--disable-log-requests"], False),
        (["--enable-log-requests"], True),
        (["--enable-log-requests", "--disable-log-requests"], False),
    ],
)
def test_prompts_reach_the_log_only_when_asked(argv, logged, caplog):
    server = cli.parse_args(argv).server
    with app_with(server.http_options(), request_logger=server.request_logger()) as c:
        with caplog.at_level(logging.DEBUG):
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert (
                c.post("/v1/completions", json={"prompt": "the dog ran fast", "max_tokens": 2}).status_code
                == 200
            )
    text = caplog.text
    assert ("the cat sat on the mat" in text) is logged and ("the dog ran fast" in text) is logged
    if logged:
        assert re.search(
            r"Received request chatcmpl-[0-9a-f]{32}: prompt: '<\|im_start\|> ?user",
            text,  # the template's text
        )
        assert re.search(r"Received request cmpl-[0-9a-f]{32}-0: prompt: 'the dog ran fast'", text)


def test_max_log_len_cuts_the_logged_prompt(caplog):
    server = cli.parse_args(["--enable-log-requests", "--max-log-len", "7"]).server
    engine = MockAsyncEngine()
    ids = engine.tokenizer.encode("the dog ran fast", add_special_tokens=False)
    with app_with(server.http_options(), request_logger=server.request_logger()) as c:
        with caplog.at_level(logging.INFO, logger="jaxllm.server.requests"):
            c.post("/v1/completions", json={"prompt": "the dog ran fast", "max_tokens": 2})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "jaxllm.server.requests"]
    assert "prompt: 'the dog'," in line and "ran" not in line.split("params:")[0]
    assert line.endswith(f"prompt_token_ids: {ids[:7]}")
