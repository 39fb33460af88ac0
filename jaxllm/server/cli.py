"""Command line: `jaxllm serve [MODEL] [flags]`, `python -m jaxllm.entrypoints.openai.api_server --model M`,
and `jaxllm doctor` (jaxllm/doctor/: the environment check, whose summary line serve() also logs).

    argv --parse_args--> ServeArgs(engine: EngineArgs, server: ServerArgs)   (flags: server/args.py;
         --config FILE.yaml and --flag_name spellings: server/config_file.py)
         --AsyncLLMEngine.from_engine_args--> engine (loads, resolves, compiles, logs what it runs with)
         --build_app--> Starlette --DrainingServer.run   (the engine failing stops it: exit status 1;
             SIGTERM drains for --shutdown-timeout, server/shutdown.py, then exits 0)
Flag names and meanings follow vLLM's. With no model the embedded SmolLM2-135M-Instruct is served.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import NamedTuple

from jaxllm.engine_args import EngineArgs, flags_without_effect
from jaxllm.hub import ModelNotFoundError
from jaxllm.server.args import (
    API_KEY_ENV,
    DEFAULT_GIL_SWITCH_INTERVAL_MS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerArgs,
    args_from_namespace,
    load_chat_template,
    make_arg_parser,
)
from jaxllm.server.config_file import expand_config_file, normalize_flag_names

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_GIL_SWITCH_INTERVAL_MS",
    "DEFAULT_MAX_REQUEST_BODY_BYTES",
    "ServeArgs",
    "load_chat_template",
    "main",
    "make_arg_parser",
    "parse_args",
    "serve",
]

logger = logging.getLogger("jaxllm.server")

# startup_info entries the engine's own log already states (its limits above all: printed once, there)
_LOGGED_BY_THE_ENGINE = (
    "model", "device", "platform", "dtype", "kv_cache_dtype", "kv_cache_scales", "attention_backend",
    "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_concurrency",
)  # fmt: skip


class ServeArgs(NamedTuple):
    engine: EngineArgs
    server: ServerArgs


def parse_args(argv: list[str] | None = None, positional_model: bool = True) -> ServeArgs:
    """Exits with status 2 and a message naming the flag on a bad value, before anything loads."""
    parser = make_arg_parser(positional_model=positional_model)
    argv = normalize_flag_names(list(sys.argv[1:] if argv is None else argv))
    ns = parser.parse_args(expand_config_file(argv, parser, positional_model))
    if positional_model and ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            parser.error(f"model given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    try:
        return ServeArgs(*args_from_namespace(ns))
    except ValueError as e:
        parser.error(str(e))


def startup_lines(info: dict, url: str) -> list[str]:
    """The server's start-up summary: the engine's start-up figures not already in its own log (one
    `key=value` line, which the benchmark tools read) and where the API is served."""
    figures = {k: v for k, v in info.items() if k not in _LOGGED_BY_THE_ENGINE}
    lines = ["Engine: " + ", ".join(f"{k}={v}" for k, v in figures.items())] if figures else []
    lines.append(
        f"Serving the OpenAI-compatible API on {url}/v1 (docs: {url}/v1/models, {url}/health, {url}/metrics)"
    )
    return lines


def http_runtime_line(switch_interval_ms: float) -> str:
    """What uvicorn's "auto" choices resolve to here (its C speedups when installed) and the GIL interval:
    all of it moves the host's time per streamed token."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    parser = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return f"HTTP: event loop {loop}, parser {parser}, GIL switch interval {switch_interval_ms:g} ms"


def log_environment(compilation_cache_dir: str | None) -> None:
    """`jaxllm doctor`'s summary in one line, once the engine has started JAX's backend (so the CUDA
    libraries it loaded can be named), then one line per problem with its fix. Never stops the server."""
    try:
        from jaxllm.doctor.checks import SERVER_START_CHECKS, run_checks
        from jaxllm.doctor.facts import gather_facts
        from jaxllm.doctor.report import summary_line

        facts = gather_facts(compilation_cache_dir)
        findings = run_checks(facts, SERVER_START_CHECKS)
    except Exception:  # noqa: BLE001 - a summary must not keep a working server from starting
        logger.exception("could not summarize the environment (run `jaxllm doctor`)")
        return
    logger.info(summary_line(facts, findings))
    for f in findings:
        (logger.error if f.level == "error" else logger.warning)(f.line())


def serve(args: ServeArgs) -> None:
    import uvicorn

    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.server.app import build_app
    from jaxllm.server.shutdown import DrainingServer

    server = args.server
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    sys.setswitchinterval(server.gil_switch_interval_ms / 1000)
    logger.info("jaxllm API server; engine arguments given: %s", args.engine.non_default() or "none")
    for line in flags_without_effect(server):
        logger.info(line)
    names = server.served_model_name
    engine_args = args.engine
    if server.enable_research_api:  # research requests then start without compiling their step
        engine_args = dataclasses.replace(engine_args, compile_research_ahead=True)
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args, served_model_name=names[0] if names else None)
    except ModelNotFoundError as e:  # the user's model path or id: one line, not a traceback
        logger.error("%s", e)
        sys.exit(1)
    log_environment(dict(engine.startup_info).get("compilation_cache"))
    channel = None
    # One mesh over several hosts: process 0 serves, the others follow (a stand-in engine has no .engine).
    dist = getattr(getattr(engine, "engine", None), "distributed", None)
    if dist is not None and dist.num_processes > 1:
        from jaxllm.parallel.follower import follow, lead

        if dist.process_id != 0:
            logger.info("process %d replays the steps of process 0 (which serves HTTP)", dist.process_id)
            follow(engine.engine)
            return
        channel = lead(engine.engine)
    # The engine failing stops uvicorn (once the requests in flight have their error); serve() then exits
    # non-zero so that a supervisor (Docker's restart policy, Kubernetes) starts a fresh server.
    http_server: uvicorn.Server | None = None

    def stop_serving() -> None:
        if http_server is not None:
            http_server.should_exit = True

    app = build_app(
        engine,
        served_model_names=names,
        api_key=server.api_key,
        chat_template=server.chat_template,
        max_request_body_bytes=server.max_request_body_bytes,
        log_stats=not server.disable_log_stats,
        max_logprobs=args.engine.max_logprobs,
        enable_auto_tool_choice=server.enable_auto_tool_choice,
        tool_call_parser=server.tool_call_parser,
        reasoning_parser=server.reasoning_parser,
        http=server.http_options(),
        request_logger=server.request_logger(),
        research_limits=server.research_limits(),
        on_engine_dead=stop_serving,
    )
    shown_host = server.host if server.host not in (None, "", "0.0.0.0") else "0.0.0.0"
    for line in startup_lines(dict(engine.startup_info), f"http://{shown_host}:{server.port}"):
        logger.info(line)
    logger.info(http_runtime_line(server.gil_switch_interval_ms))
    config = uvicorn.Config(
        app,
        host=server.host or "0.0.0.0",
        port=server.port,
        log_level=server.uvicorn_log_level,
        access_log=not server.disable_uvicorn_access_log,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
    )
    fail_in_flight = getattr(engine, "fail_in_flight", None)
    http_server = DrainingServer(
        config,
        shutdown_timeout_s=server.shutdown_timeout,
        on_drain_timeout=(
            (lambda: fail_in_flight("the server shut down before this request finished"))
            if fail_in_flight is not None
            else None
        ),
        in_flight=lambda: _in_flight(engine),
    )
    try:
        http_server.run()
    finally:
        if channel is not None:
            channel.stop()  # lets the followers return
    failure = getattr(engine, "errored", None)
    if failure is not None:
        logger.error("exiting with status 1 because the engine failed: %r", failure)
        sys.exit(1)
    if http_server.terminated:
        logger.info("shut down on SIGTERM; exiting with status 0")


def _in_flight(engine) -> int | None:
    """Requests the engine holds, running or waiting (None: an engine without stats)."""
    try:
        s = engine.get_stats()
        return s.num_requests_running + s.num_requests_waiting
    except Exception:  # noqa: BLE001 - only for a log line
        return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxllm serve [MODEL] [flags]   (jaxllm serve --help for the flags)")
        print("       jaxllm doctor [--json]         (checks the environment: versions, GPU, CUDA libraries)")
        sys.exit(0 if argv else 2)
    if argv[0] == "doctor":
        from jaxllm.doctor import main as doctor

        sys.exit(doctor(argv[1:]))
    if argv[0] != "serve":
        print(
            f"jaxllm: unknown command {argv[0]!r}; the commands are `jaxllm serve [MODEL] [flags]` and "
            "`jaxllm doctor`",
            file=sys.stderr,
        )
        sys.exit(2)
    serve(parse_args(argv[1:]))


def api_server_main(argv: list[str] | None = None) -> None:
    """`python -m jaxllm.entrypoints.openai.api_server --model M ...` (no positional model, as vLLM)."""
    serve(parse_args(sys.argv[1:] if argv is None else argv, positional_model=False))


if __name__ == "__main__":
    main()
