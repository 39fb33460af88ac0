"""Command line: `jaxllm serve [MODEL] [flags]` and `python -m jaxllm.entrypoints.openai.api_server --model M`.

    argv --make_arg_parser / parse_args--> Namespace --engine_config_from_args--> EngineConfig
         --AsyncLLMEngine.from_config--> engine (loads, compiles) --build_app--> Starlette --uvicorn.run
Flag names and meanings follow vLLM's. With no model the embedded SmolLM2-135M-Instruct is served.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxllm.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    ModelSpec,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)

logger = logging.getLogger("jaxllm.server")
API_KEY_ENV = "JAXLLM_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# The engine thread and the event loop's HTTP work share the GIL. With Python's default 5 ms interval a
# step that wants the GIL back waits behind SSE/JSON work: on the H200 (Llama-3.1-8B shape, 32 streams of
# 512 -> 256) the median TPOT was 7.82 ms at 5 ms, 6.45 at 1 ms, 6.06 at 0.05 ms
# (benchmarks/results/2026-12-05-h200-serve-llama8b-engine-thread-switch-*.json).
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.05


def make_arg_parser(prog: str = "jaxllm serve", positional_model: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for jaxllm (vLLM's flags).")
    if positional_model:
        p.add_argument("model_tag", nargs="?", default=None, help="model to serve (same as --model)")
    p.add_argument(
        "--model",
        default=None,
        help="HF folder, GGUF file or preset; default: embedded SmolLM2-135M-Instruct",
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--coordinator-address",
        default=None,
        help="host:port of process 0 for a mesh over several hosts (also JAXLLM_COORDINATOR_ADDRESS)",
    )
    p.add_argument("--num-processes", type=int, default=1, help="processes (hosts) in the mesh")
    p.add_argument("--process-id", type=int, default=0, help="this process's rank, 0 .. num_processes-1")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=None, help="CPU swap space per GPU (GiB)")
    p.add_argument(
        "--enforce-eager", action="store_true", help="skip ahead-of-time compilation of the buckets"
    )
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule the next step while the device runs the current one (default: on)",
    )
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None, help=f"required key for /v1 (also from ${API_KEY_ENV})")
    p.add_argument("--chat-template", default=None, help="a Jinja template file, or the template itself")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: pallas-hopper on an H100/H200 (sm_90), pallas on other GPUs, reference elsewhere; "
        "pallas-hopper: decode batches and long prefill chunks on the Mosaic GPU kernels, the rest on the "
        "Triton-lowered pallas kernel",
    )
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument(
        "--executable-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the compiled step executables under the compilation cache and load them at the next "
        "start without tracing (the key holds the engine's source, versions, device and shapes); on by "
        "default for the server on a GPU",
    )
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
        help="how long a Python thread may hold the GIL while another waits for it (sys.setswitchinterval); "
        "Python's 5 ms lets the HTTP work hold back the engine thread's next step",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    return p


def load_chat_template(value: str | None) -> str | None:
    """A path to a template file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template={value!r} is neither a readable file nor a Jinja template")
    return value


def parse_args(argv: list[str] | None = None, positional_model: bool = True) -> argparse.Namespace:
    parser = make_arg_parser(positional_model=positional_model)
    args = parser.parse_args(argv)
    if positional_model and args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"model given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if not args.gil_switch_interval_ms > 0:
        parser.error(f"--gil-switch-interval-ms must be > 0, got {args.gil_switch_interval_ms}")
    try:
        args.chat_template_text = load_chat_template(args.chat_template)
        engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Maps vLLM-named flags onto EngineConfig; raises ValueError (naming the field) on a bad value."""
    chunked = args.enable_chunked_prefill
    sched: dict = {}
    if args.max_num_seqs is not None:
        sched["max_num_seqs"] = args.max_num_seqs
    if args.max_model_len is not None:
        sched["max_model_len"] = args.max_model_len
    if chunked is not None:
        sched["enable_chunked_prefill"] = chunked
    sched["async_scheduling"] = args.async_scheduling
    if args.max_num_batched_tokens is not None:
        sched["max_num_batched_tokens"] = args.max_num_batched_tokens
    elif chunked is False:
        # As vLLM: without chunking a whole prompt must fit one step.
        sched["max_num_batched_tokens"] = max(args.max_model_len or 2048, 2048)
    cache: dict = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.block_size is not None:
        cache["block_size"] = args.block_size
    if args.swap_space is not None:
        cache["swap_space_gib"] = args.swap_space
    if args.enable_prefix_caching is not None:
        cache["enable_prefix_caching"] = args.enable_prefix_caching
    if args.num_gpu_blocks_override is not None:
        cache["num_gpu_blocks_override"] = args.num_gpu_blocks_override
    runner: dict = {
        "attention_backend": args.attention_backend,
        "enforce_eager": args.enforce_eager,
        "executable_cache": args.executable_cache,
    }
    if args.compilation_cache_dir is not None:
        runner["compilation_cache_dir"] = args.compilation_cache_dir
    if args.max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes={args.max_request_body_bytes} must be >= 1")
    if args.port is not None and not 0 <= args.port < 65536:
        raise ValueError(f"port={args.port} must be in [0, 65535]")
    return EngineConfig(
        model=ModelSpec(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            load_format=args.load_format,
            quantization=args.quantization,
            seed=args.seed,
            max_model_len=args.max_model_len,
            served_model_name=args.served_model_name[0] if args.served_model_name else None,
            chat_template=getattr(args, "chat_template_text", None),
        ),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**sched),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        ),
        runner=RunnerConfig(**runner),
    )


def user_set_fields(args: argparse.Namespace) -> frozenset[str]:
    """Scheduler fields given on the command line (the engine picks platform defaults for the others)."""
    names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
    return frozenset(n for n in names if getattr(args, n) is not None)


def startup_lines(info: dict, max_model_len: int, url: str) -> list[str]:
    """vLLM-style startup summary from the engine's startup_info."""
    lines = [
        f"Model: {info.get('model', '?')}, dtype: {info.get('dtype', '?')}, max_model_len: {max_model_len}"
    ]
    if "num_gpu_blocks" in info:
        lines.append(f"# GPU blocks: {info['num_gpu_blocks']}, block size: {info.get('block_size', '?')}")
    if "max_concurrency" in info:
        lines.append(
            f"Maximum concurrency for {max_model_len} tokens per request: {float(info['max_concurrency']):.2f}x"
        )
    if "compile_time_s" in info:
        lines.append(f"Compilation and warm-up took {float(info['compile_time_s']):.2f} s")
    shown = {"model", "dtype", "num_gpu_blocks", "block_size", "max_concurrency", "compile_time_s"}
    extra = {k: v for k, v in info.items() if k not in shown}
    if extra:
        lines.append("Engine: " + ", ".join(f"{k}={v}" for k, v in extra.items()))
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


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from jaxllm.engine.async_engine import AsyncLLMEngine
    from jaxllm.server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    sys.setswitchinterval(args.gil_switch_interval_ms / 1000)
    config = engine_config_from_args(args)
    logger.info("jaxllm API server; engine config: %s", config)
    engine = AsyncLLMEngine.from_config(config, user_set=user_set_fields(args))
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
    app = build_app(
        engine,
        served_model_names=args.served_model_name,
        api_key=args.api_key,
        chat_template=args.chat_template_text,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    shown_host = args.host if args.host not in (None, "", "0.0.0.0") else "0.0.0.0"
    for line in startup_lines(
        dict(engine.startup_info), engine.max_model_len, f"http://{shown_host}:{args.port}"
    ):
        logger.info(line)
    logger.info(http_runtime_line(args.gil_switch_interval_ms))
    try:
        uvicorn.run(app, host=args.host or "0.0.0.0", port=args.port, log_level=args.uvicorn_log_level)
    finally:
        if channel is not None:
            channel.stop()  # lets the followers return


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxllm serve [MODEL] [flags]   (jaxllm serve --help for the flags)")
        sys.exit(0 if argv else 2)
    if argv[0] != "serve":
        print(
            f"jaxllm: unknown command {argv[0]!r}; the command is `jaxllm serve [MODEL] [flags]`",
            file=sys.stderr,
        )
        sys.exit(2)
    serve(parse_args(argv[1:]))


def api_server_main(argv: list[str] | None = None) -> None:
    """`python -m jaxllm.entrypoints.openai.api_server --model M ...` (no positional model, as vLLM)."""
    serve(parse_args(sys.argv[1:] if argv is None else argv, positional_model=False))


if __name__ == "__main__":
    main()
