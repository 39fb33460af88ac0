"""The command line's flags, generated from two dataclasses: EngineArgs (every engine option) and
ServerArgs (what only the HTTP server has). Each field's metadata gives its help, extra flag names and
allowed values; its type gives the argparse type (bool: --x / --no-x; dict: a JSON object; list: one or
more values). A flag therefore exists exactly when the field does, and has the field's default.

    argv --make_arg_parser().parse_args--> Namespace --args_from_namespace--> (EngineArgs, ServerArgs)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from typing import Any

from jaxllm.engine_args import EngineArgs, arg_field, base_type, check_field, flag_name
from jaxllm.server.http_options import HTTPOptions
from jaxllm.server.request_log import RequestLogger
from jaxllm.server.research import (
    DEFAULT_MAX_CAPTURE_BYTES,
    DEFAULT_MAX_SITES,
    DEFAULT_MAX_STEERS,
    ResearchLimits,
)

# The parsers' names (jaxllm/server/tool_parsers/, jaxllm/server/reasoning/), written out so that the
# flags are known without importing the parsers.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen")
REASONING_PARSERS = ("deepseek_r1", "qwen3")

API_KEY_ENV = "JAXLLM_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # what vLLM deployments set; JAXLLM_API_KEY wins when both are
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# The engine thread and the event loop's HTTP work share the GIL. With Python's default 5 ms interval, a
# step that wants the GIL back waits behind SSE and JSON work for up to that long, which shows directly in
# every stream's time per output token; a short interval hands the GIL back to the step thread promptly.
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.05
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, slots=True)
class ServerArgs:
    host: str | None = arg_field(None, "bind address (default: all interfaces)")
    port: int = arg_field(8000, "port", ge=0, le=65535)
    api_key: str | None = arg_field(
        None, f"key every /v1 request must carry (default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV})"
    )
    served_model_name: list[str] | None = arg_field(
        None, "the model's names in the API; the first is reported in responses (default: the model's)"
    )
    chat_template: str | None = arg_field(
        None, "a Jinja chat template, or a file holding one, instead of the tokenizer's"
    )
    max_request_body_bytes: int = arg_field(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "largest request body accepted", ge=1
    )
    gil_switch_interval_ms: float = arg_field(
        DEFAULT_GIL_SWITCH_INTERVAL_MS,
        "how long a Python thread may hold the GIL while another waits for it (sys.setswitchinterval); "
        "Python's 5 ms lets the HTTP work hold back the engine thread's next step",
        gt=0.0,
    )
    enable_auto_tool_choice: bool = arg_field(
        False,
        'tool_choice "auto" (the default with tools): the model decides, --tool-call-parser reads its calls',
    )
    tool_call_parser: str | None = arg_field(
        None,
        "how the model writes tool calls: hermes and qwen (<tool_call> JSON </tool_call>), llama3_json, "
        "mistral",
        choices=(None, *TOOL_CALL_PARSERS),
    )
    reasoning_parser: str | None = arg_field(
        None,
        "split <think> text into reasoning_content: deepseek_r1 (the output starts inside it), qwen3",
        choices=(None, *REASONING_PARSERS),
    )
    enable_research_api: bool = arg_field(
        False,
        "serve the `research` request field (activations captured, steering vectors added: docs/research.md); "
        "off, a request carrying it is refused with a 400",
    )
    max_research_capture_bytes: int = arg_field(
        DEFAULT_MAX_CAPTURE_BYTES,
        "most bytes of activations one request may capture, estimated before it runs from its prompt, "
        "max_tokens, n and sites",
        ge=1,
    )
    max_research_sites: int = arg_field(DEFAULT_MAX_SITES, "most capture sites one request may name", ge=1)
    max_research_steers: int = arg_field(
        DEFAULT_MAX_STEERS, "most steering vectors one request may give", ge=1
    )
    uvicorn_log_level: str = arg_field("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    disable_log_stats: bool = arg_field(False, "no periodic log line of throughput and KV cache use")
    enable_log_requests: bool = arg_field(
        False, "log each generation request: its id, prompt (text and token ids) and sampling parameters"
    )
    disable_log_requests: bool = arg_field(
        False, "log no requests (the default; vLLM's older flag), even with --enable-log-requests"
    )
    max_log_len: int | None = arg_field(
        None, "most prompt characters and token ids a request's log line shows (default: all)", ge=0
    )
    disable_uvicorn_access_log: bool = arg_field(False, "no uvicorn access-log line per HTTP request")
    shutdown_timeout: float = arg_field(
        30.0,
        "on SIGTERM (or Ctrl-C): stop accepting connections and let the requests in flight finish for up to "
        "this many seconds; those still running then end with an error (a 503, or an error event in a "
        "stream) and the process exits 0. 0: end them at once (vLLM's default)",
        ge=0.0,
    )
    # ---- HTTP, as a deployment sets it (http_options.py) ----------------------------------------------
    root_path: str | None = arg_field(
        None,
        "the path prefix a reverse proxy serves the API under (FastAPI's root_path, as vLLM): routes answer "
        "with and without it, /openapi.json names it",
    )
    allowed_origins: list[str] | None = arg_field(
        None, 'CORS: allowed origins, a JSON list (default: ["*"], as vLLM)', json_list=True
    )
    allowed_methods: list[str] | None = arg_field(
        None, 'CORS: allowed methods, a JSON list (default: ["*"])', json_list=True
    )
    allowed_headers: list[str] | None = arg_field(
        None, 'CORS: allowed request headers, a JSON list (default: ["*"])', json_list=True
    )
    allow_credentials: bool = arg_field(False, "CORS: allow credentials (cookies, Authorization)")
    enable_request_id_headers: bool = arg_field(
        False, "an X-Request-Id header on every response: the request's own, else a new id"
    )
    disable_fastapi_docs: bool = arg_field(False, "serve no /openapi.json (jaxllm has no /docs or /redoc)")
    ssl_keyfile: str | None = arg_field(None, "TLS: the private key file (HTTPS, with --ssl-certfile)")
    ssl_certfile: str | None = arg_field(None, "TLS: the certificate file")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_field(f, getattr(self, f.name), _SERVER_TYPES)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice=True (--enable-auto-tool-choice) requires --tool-call-parser"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile (--ssl-keyfile) and ssl_certfile (--ssl-certfile) go together")
        self.http_options()  # checks --root-path

    def http_options(self) -> HTTPOptions:
        return HTTPOptions(
            allowed_origins=tuple(self.allowed_origins or ("*",)),
            allowed_methods=tuple(self.allowed_methods or ("*",)),
            allowed_headers=tuple(self.allowed_headers or ("*",)),
            allow_credentials=self.allow_credentials,
            enable_request_id_headers=self.enable_request_id_headers,
            root_path=self.root_path or "",
            serve_openapi=not self.disable_fastapi_docs,
        )

    def research_limits(self) -> ResearchLimits:
        return ResearchLimits(
            enabled=self.enable_research_api,
            max_capture_bytes=self.max_research_capture_bytes,
            max_sites=self.max_research_sites,
            max_steers=self.max_research_steers,
        )

    def request_logger(self) -> RequestLogger | None:
        """A request log line only when asked for and not refused (--disable-log-requests wins)."""
        if self.enable_log_requests and not self.disable_log_requests:
            return RequestLogger(self.max_log_len)
        return None


_SERVER_TYPES = typing.get_type_hints(ServerArgs)


def _json_flag(flag: str, fits, expected: str):
    """An argparse type: the flag's JSON value, refused naming the flag unless fits(value)."""

    def parse(text: str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({e}): {text!r}") from None
        if not fits(value):
            raise argparse.ArgumentTypeError(f"{flag}: must be {expected}, got {text!r}")
        return value

    return parse


def _json_list(flag: str):
    return _json_flag(
        flag, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a JSON list of strings"
    )


def _json_object(flag: str):
    return _json_flag(flag, lambda v: isinstance(v, dict), "a JSON object")


class _AddsArguments(typing.Protocol):
    """An argparse parser or one of its argument groups (what add_argument_group returns)."""

    def add_argument(self, *names: str, **kwargs: typing.Any) -> argparse.Action: ...


def add_flags(parser: _AddsArguments, cls: type) -> None:
    """One flag per field of the dataclass `cls`: `--field-name` plus the field's aliases."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        md, typ = f.metadata, base_type(hints[f.name])
        flag = flag_name(f.name)
        help_text = md["help"]
        if f.default is not None and typ is not bool:
            help_text += f" (default: {f.default})"
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text.replace("%", "%%")}
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typ is dict:
            kw["type"], kw["metavar"] = _json_object(flag), "JSON"
        elif typ is list and md.get("json_list"):
            kw["type"], kw["metavar"] = _json_list(flag), "JSON"
        elif typ is list:
            kw["nargs"] = "+"
        else:
            kw["type"] = typ
            if md["choices"] is not None:
                kw["choices"] = [c for c in md["choices"] if c is not None]
        parser.add_argument(flag, *md["aliases"], **kw)


def make_arg_parser(prog: str = "jaxllm serve", positional_model: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="OpenAI-compatible server for jaxllm (vLLM's flag names)."
    )
    if positional_model:
        p.add_argument("model_tag", nargs="?", default=None, help="model to serve (same as --model)")
    p.add_argument(
        "--config",
        metavar="YAML",
        help="a YAML file of flag values (keys: the flags' names without dashes); flags given on the "
        "command line win (config_file.py)",
    )
    add_flags(p.add_argument_group("engine"), EngineArgs)
    add_flags(p.add_argument_group("server"), ServerArgs)
    return p


def args_from_namespace(ns: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    """Raises ValueError naming the field and its flag on a bad value (EngineArgs / ServerArgs checks)."""
    engine = EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
    server = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)}
    server["api_key"] = (
        server["api_key"] or os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None
    )
    server["chat_template"] = load_chat_template(server["chat_template"])
    return engine, ServerArgs(**server)


def load_chat_template(value: str | None) -> str | None:
    """A path to a template file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(
            f"chat_template={value!r} (--chat-template) is neither a readable file nor a Jinja template"
        )
    return value
