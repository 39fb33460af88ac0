"""Online benchmark for any OpenAI-compatible server, with vLLM benchmark_serving's metrics.

    [--launch "jaxllm serve ..." -> wait for /health]
    requests (--workload random | shared-prefix | chat token ids, workload.py; or --dataset)
        --arrivals: Poisson at --request-rate (inf: all at once), at most --max-concurrency in flight-->
        streaming POST /v1/completions (ignore_eos, include_usage;
        serve_client.py)
        --per request: TTFT, ITL gaps, E2E latency, token counts--> serving_metrics (+ goodput)
        --offline_bound on the same lengths, on the server's card (its log's "device:" line, else
        nvidia-smi's; none for a card without peaks)--> roofline line
        --> benchmarks/results/<date>-<device>-<name>.json
    a level in which not every request finished keeps its counts but no figures; the run then exits 1
    --workload shared-prefix: each level has a system prompt of its own, sent once untimed first (a
        running service has its system prompt cached); the server's prefix-cache hit rate is reported
    --sweep-concurrency 1,8,32 [--sweep-num-prompts 4,16,64]: one run per concurrency, each on its own
        random prompts (so that prefix caching finds none of them) -> table of median/mean/p99 TTFT, TPOT,
        ITL, E2E, tok/s, req/s, GPU utilization; --target c32:median_tpot_ms<=5.5 checks a level
    --sweep-deadline T (Unix time): levels not started by T are skipped, a running one is cut at T; the
        result file is rewritten after every level, so a run stopped early keeps what it measured
    --report FILE...: print a saved sweep (and startup) result as markdown

    python -m benchmarks.serve --launch "jaxllm serve llama-3.1-8b --load-format dummy --port 8000" \
        --model llama-3.1-8b --num-prompts 500 --input-len 512 --output-len 128 --request-rate 8 \
        --goodput ttft:500 tpot:50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.finished import IncompleteRun, exit_on_incomplete
from benchmarks.roofline import (
    HARDWARE_CHOICES,
    hardware_for_device,
    no_bound_line,
    offline_bound,
    roofline_line,
    shape_for_model,
)
from benchmarks.serve_client import CUT, arrival_gaps, run_load, send_request  # noqa: F401 - serve.X names
from benchmarks.serve_metrics import (
    RequestTiming,
    check_targets,
    parse_goodput,
    parse_target,
    serving_metrics,
    sweep_row,
    sweep_table,
    targets_table,
)
from benchmarks.server_process import (
    GpuMonitor,
    cache_file_count,
    engine_counters,
    engine_startup_from_log,
    flag_value,
    launch_server,
    prefix_cache_counters,
    step_breakdown,
    wait_for_background_compiles,
    write_synthetic_tokenizer,
)
from benchmarks.startup import startup_table
from benchmarks.workload import (
    BenchRequest,
    add_workload_args,
    cached_prefix_lens,
    gpu_name,
    hf_config_for_model,
    load_jsonl,
    make_result,
    save_result,
    workload_label,
    workload_requests,
)
from jaxllm.stats import STEP_HOST_PHASES

logger = logging.getLogger("jaxllm.benchmarks")
EMBEDDED_NAMES = ("SmolLM2-135M-Instruct", "embedded")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Online serving benchmark (vLLM's benchmark_serving metrics).")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send; default: the first of GET /v1/models")
    p.add_argument(
        "--shape-model",
        default=None,
        help="preset, HF folder or GGUF giving the shape for the roofline and the vocabulary; default: from "
        "--model or the --launch command",
    )
    p.add_argument(
        "--launch", default=None, help='start this server command first, e.g. "jaxllm serve --port 8000"'
    )
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--server-log", default=None, help="where the launched server's output goes")
    p.add_argument(
        "--synthetic-tokenizer",
        default=None,
        metavar="DIR",
        help="write a word-level tokenizer of the shape model's vocabulary to DIR before --launch (for "
        "random-weight presets, which have none; the launch command passes --tokenizer DIR)",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    add_workload_args(p)
    p.add_argument(
        "--dataset", default=None, help="JSONL: {prompt | prompt_token_ids, [output_len]} per line"
    )
    p.add_argument("--vocab-size", type=int, default=None, help="for random ids when the shape is unknown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf: all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="+", default=None, help="SLO limits in ms: ttft:500 tpot:50 e2el:10000")
    p.add_argument("--sweep-concurrency", default=None, help="e.g. 1,8,32,64,128: one run per concurrency")
    p.add_argument(
        "--sweep-num-prompts",
        default=None,
        help="prompts per sweep level, e.g. 4,16,64 (default --num-prompts)",
    )
    p.add_argument(
        "--warmup-prompts", type=int, default=0, help="untimed requests before the first level (GPU clocks)"
    )
    p.add_argument("--sweep-deadline", type=float, default=None, help="Unix time by which the runs must end")
    p.add_argument(
        "--compile-wait-s", type=float, default=180.0,
        help="before the timed runs, wait up to this long for the server's background compiles "
        "(jaxllm:num_compiling_in_background on /metrics; other servers: no wait); 0: do not wait",
    )  # fmt: skip
    p.add_argument(
        "--gpu-util-interval", type=float, default=0.5,
        help="seconds between nvidia-smi polls for the GPU utilization column; 0 leaves it out "
        "(each poll runs nvidia-smi on the server's machine)",
    )  # fmt: skip
    p.add_argument(
        "--target",
        nargs="+",
        default=[],
        help="limits to check, e.g. c32:median_tpot_ms<=5.5 c1:output_throughput>=250",
    )
    p.add_argument(
        "--report", nargs="+", default=None, metavar="JSON", help="print saved results; run nothing"
    )
    p.add_argument(
        "--hardware",
        choices=HARDWARE_CHOICES,
        default="auto",
        help="peaks for the roofline (auto: those of the server's card; none for a card without an entry)",
    )
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--name", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    return p


def served_model(base_url: str) -> str:
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30.0)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def model_from_launch(command: str | None) -> str | None:
    """The MODEL of `jaxllm serve MODEL ...` or `... --model MODEL`, if any."""
    if not command:
        return None
    argv = shlex.split(command)
    if "--model" in argv[:-1]:
        return argv[argv.index("--model") + 1]
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1 :]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    return None


# ---- reports -------------------------------------------------------------------------------------------
def roofline_for(
    shape, timings: list[RequestTiming], requests, max_batch: int, duration: float, hw, primer=None
):
    """The bound of a level whose requests all finished (None otherwise, or without a shape or card).
    `primer`: the untimed request sent first, whose prefix the cache already holds."""
    if shape is None or hw is None or not all(t.success for t in timings):
        return None
    in_lens = [t.prompt_len or r.input_len for t, r in zip(timings, requests, strict=True)]
    cached = None
    if all(isinstance(r.prompt, list) for r in requests):
        primers = [primer.prompt] if primer is not None else []
        cached = cached_prefix_lens([r.prompt for r in requests], primers)
    bound = offline_bound(
        shape,
        in_lens,
        [max(t.output_tokens, 1) for t in timings],
        max(1, min(max_batch, len(timings))),
        hw,
        cached_lens=cached,
    )
    return {
        **bound.to_dict(),
        "achieved_share": bound.seconds / duration,
        "line": roofline_line(bound, duration),
    }


def print_metrics(m: dict[str, Any], roof: dict | None, no_roof: str) -> None:
    print(f"successful requests: {m['completed']} (failed {m['failed']}), duration {m['duration_s']:.2f} s")
    if m.get("incomplete"):
        total = m["completed"] + m["failed"]
        print(f"only {m['completed']} of {total} requests finished: no throughput or latency is reported")
        return
    print(
        f"request throughput {m['request_throughput']:.2f} req/s, output {m['output_throughput']:,.1f} tok/s, "
        f"total {m['total_token_throughput']:,.1f} tok/s"
    )
    if "request_goodput" in m:
        print(f"goodput {m['request_goodput']:.2f} req/s ({m['good_requests']} requests met the limits)")
    for k, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        print(
            f"{label:12s} mean {m[f'mean_{k}_ms']:9.2f} ms  median {m[f'median_{k}_ms']:9.2f} ms  "
            f"p99 {m[f'p99_{k}_ms']:9.2f} ms"
        )
    print(roof["line"] if roof else no_roof)


def level_sizes(args: argparse.Namespace) -> tuple[list[int | None], list[int]]:
    """Concurrency and number of prompts of each run (one run without --sweep-concurrency)."""
    if not args.sweep_concurrency:
        if args.sweep_num_prompts:
            raise ValueError("--sweep-num-prompts needs --sweep-concurrency")
        return [args.max_concurrency], [args.num_prompts]
    levels = [int(x) for x in args.sweep_concurrency.split(",")]
    if min(levels) < 1:
        raise ValueError(f"--sweep-concurrency={args.sweep_concurrency} must list integers >= 1")
    if not args.sweep_num_prompts:
        return levels, [args.num_prompts] * len(levels)
    counts = [int(x) for x in args.sweep_num_prompts.split(",")]
    if len(counts) != len(levels) or min(counts) < 1:
        raise ValueError(
            f"--sweep-num-prompts={args.sweep_num_prompts} must give one count >= 1 for each of "
            f"--sweep-concurrency={args.sweep_concurrency}"
        )
    return levels, counts


def split_requests(requests: list[BenchRequest], sizes: list[int]) -> list[list[BenchRequest]]:
    """Consecutive slices of the given sizes; a dataset shorter than that is reused from its start."""
    out, at = [], 0
    for n in sizes:
        if at + n > len(requests):
            at = 0
        out.append(requests[at : at + n])
        at += n
    return out


def make_requests(args: argparse.Namespace, vocab: int | None, sizes: list[int]) -> list[list[BenchRequest]]:
    """One list of requests per size: random and chat ones are all distinct, so no run finds another's
    prefix; shared-prefix ones share a system prompt within a list (each its own, from seed + i), and
    each list has one more request than its size, the primer sent untimed first."""
    if args.dataset:
        return split_requests(load_jsonl(args.dataset, args.output_len, sum(sizes)), sizes)
    if vocab is None:
        raise ValueError("the model's vocabulary is unknown: pass --vocab-size or --shape-model")
    if args.workload == "shared-prefix":
        return [workload_requests(args, n + 1, vocab, args.seed + i) for i, n in enumerate(sizes)]
    return split_requests(workload_requests(args, sum(sizes), vocab, args.seed), sizes)


def prepare_tokenizer(directory: str, shape_name: str | None) -> None:
    if shape_name is None or shape_name in EMBEDDED_NAMES:
        raise ValueError("--synthetic-tokenizer needs a preset or HF folder as --shape-model")
    cfg = hf_config_for_model(shape_name)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = cfg.get("bos_token_id")
    write_synthetic_tokenizer(directory, int(cfg["vocab_size"]), int(bos or 0), int(eos or 0))


def server_startup(server, command: str, cache_files_before: int | None) -> dict[str, Any]:
    return {
        "ready_s": round(server.ready_s, 3),
        "command": command,
        "compilation_cache_dir": flag_value(command, "--compilation-cache-dir"),
        "cache_files_before": cache_files_before,
        "log": server.log_path,
        "engine": engine_startup_from_log(server.log_path),
    }


def build_result(
    args: argparse.Namespace,
    name: str,
    shape_name: str | None,
    runs: list[dict],
    startup: dict | None,
    compile_wait_s: float | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    args_d = {**vars(args), "request_rate": str(args.request_rate)}
    extra = {
        "device": device,
        "workload": workload_label(args) if not args.dataset else "dataset " + args.dataset,
        "server_ready_s": startup["ready_s"] if startup else None,
        "server_startup": startup,
        "background_compile_wait_s": compile_wait_s,
    }
    if not args.sweep_concurrency:
        r = runs[0]
        results = {**r["metrics"], "gpu_util_pct": r["gpu_util_pct"], "errors": r["errors"]}
        return make_result("serve", name, shape_name, args_d, results, r["roofline"], **extra)
    rows = [
        sweep_row(
            r["concurrency"],
            r["metrics"],
            r["gpu_util_pct"],
            cut=r["cut"],
            roofline_share=r["roofline"]["achieved_share"] if r["roofline"] else None,
        )
        for r in runs
    ]
    targets = check_targets(rows, args.target)
    results = {"sweep": rows, "table": sweep_table(rows), "targets": targets, "runs": runs}
    roof = runs[-1]["roofline"] if runs else None
    return make_result("serve-sweep", name, shape_name, args_d, results, roof, **extra)


def report(paths: list[str]) -> str:
    """Markdown of saved serve-sweep, serve and startup results."""
    parts = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        res, kind = r["results"], r["benchmark"]
        head = f"### {r['name']} ({kind}, {r['device']}, {r['date'][:10]}, {Path(path).name})"
        if kind == "serve-sweep":
            parts += [head, "", res["table"], ""]
            if res.get("targets"):
                parts += [targets_table(res["targets"]), ""]
        elif kind == "serve":
            parts += [head, "", sweep_table([sweep_row(None, res, res.get("gpu_util_pct"))]), ""]
        elif kind == "startup":
            parts += [head, "", startup_table(res), ""]
        st = r.get("server_startup")
        if st:
            eng = st.get("engine") or {}
            figures = ", ".join(
                f"{k} {eng.get(k, 'n/a')}"
                for k in ("load_time_s", "compile_time_s", "compiled_variants", "num_gpu_blocks")
            )
            parts.append(
                f"server ready {st['ready_s']:.1f} s after launch (compilation cache held "
                f"{st.get('cache_files_before')} files before it; engine: {figures})"
            )
            parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.report:
        text = report(args.report)
        print(text)
        return {"report": text}
    goodput = parse_goodput(args.goodput)
    for spec in args.target:
        parse_target(spec)
    levels, counts = level_sizes(args)
    shape_name = args.shape_model or model_from_launch(args.launch) or args.model
    if args.synthetic_tokenizer:
        prepare_tokenizer(args.synthetic_tokenizer, shape_name)
    server, startup = None, None
    if args.launch:
        cache_before = cache_file_count(flag_value(args.launch, "--compilation-cache-dir"))
        server = launch_server(args.launch, args.base_url, args.launch_timeout, log_path=args.server_log)
        startup = server_startup(server, args.launch, cache_before)
        print(f"server ready in {server.ready_s:.1f} s (log: {server.log_path}): {startup['engine']}")
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    try:
        model = args.model or served_model(args.base_url)
        shape_name = shape_name or model
        shape = shape_for_model(None if shape_name in EMBEDDED_NAMES else shape_name)
        vocab = args.vocab_size or (shape.vocab_size if shape else None)
        # The probe and the warm-up get prompts of their own, as every level does.
        probe, warmup, *per_level = make_requests(args, vocab, [1, max(args.warmup_prompts, 1), *counts])
        name = (
            args.name
            or f"serve-{Path(str(shape_name)).name}-{sum(counts)}x{args.input_len}x{args.output_len}"
        )
        device = ((startup or {}).get("engine") or {}).get("device_kind") or gpu_name() or "cpu"
        hw = hardware_for_device(args.hardware, str(device))
        no_roof = (
            "roofline: n/a (model shape unknown; pass --shape-model)"
            if shape is None
            else no_bound_line(device)
        )
        primed = args.workload == "shared-prefix" and not args.dataset

        def load(reqs: list[BenchRequest], conc: int | None, timed: bool = True):
            """A timed level arrives at --request-rate and ends by --sweep-deadline; others all at once."""
            rate = args.request_rate if timed else math.inf
            deadline = args.sweep_deadline if timed else None
            return asyncio.run(
                run_load(
                    args.base_url,
                    model,
                    reqs,
                    rate,
                    conc,
                    args.temperature,
                    args.seed,
                    args.request_timeout,
                    deadline,
                )
            )

        # One request first, so that a broken setup fails before the timed runs.
        first = probe[-1]
        (t,), _ = load([BenchRequest(first.prompt, first.input_len, min(4, first.output_len))], 1, False)
        if not t.success:
            raise RuntimeError(f"the first request failed: {t.error}")
        if args.warmup_prompts > 0:
            _, secs = load(warmup, max(c or len(warmup) for c in levels), False)
            print(f"warm-up: {len(warmup)} requests in {secs:.1f} s (not counted)")
        waited = None
        if args.compile_wait_s > 0:
            status = wait_for_background_compiles(args.base_url, args.compile_wait_s)
            if status is not None:
                waited, left = status
                print(
                    f"waited {waited:.1f} s for the server's background compiles"
                    + (f"; {left} still compiling (--compile-wait-s)" if left else "")
                )

        for conc, reqs in zip(levels, per_level, strict=True):
            if args.sweep_deadline is not None and time.time() >= args.sweep_deadline:
                print(f"== concurrency {conc}: skipped, the sweep deadline has passed")
                continue
            primer = None
            if primed:  # the level's system prompt into the prefix cache, untimed
                primer, *reqs = reqs
                load([primer], 1, False)
            counters = engine_counters(args.base_url)
            hits0 = prefix_cache_counters(args.base_url)
            with GpuMonitor(args.gpu_util_interval) as gpu:
                timings, duration = load(reqs, conc)
            steps = step_breakdown(counters, engine_counters(args.base_url), duration)
            hits1 = prefix_cache_counters(args.base_url)
            m = serving_metrics(timings, duration, goodput)
            if hits0 and hits1 and hits1["queries"] > hits0["queries"]:
                m["prefix_cache_hit_rate"] = (hits1["hits"] - hits0["hits"]) / (
                    hits1["queries"] - hits0["queries"]
                )
            roof = roofline_for(shape, timings, reqs, conc or len(reqs), duration, hw, primer)
            print(
                f"== serve: {model} at {args.base_url} on {device}, concurrency {conc or 'unlimited'}, "
                f"{len(reqs)} requests ({workload_label(args)}), rate {args.request_rate}"
            )
            if "prefix_cache_hit_rate" in m:
                print(f"prefix cache hits: {m['prefix_cache_hit_rate']:.1%} of prompt tokens")
            print_metrics(m, roof, no_roof)
            if steps is not None and steps["steps"]:
                print(
                    f"engine: {steps['steps']} steps, {steps['mean_step_ms']:.2f} ms each on average; the step "
                    f"thread waited on the device {steps['device_wait_share']:.0%} of the run "
                    f"({steps['device_wait_ms_per_step']:.2f} ms per step)"
                    + "".join(
                        f"; {phase} {steps[f'host_{phase}_ms_per_step']:.2f} ms"
                        for phase in STEP_HOST_PHASES
                        if f"host_{phase}_ms_per_step" in steps
                    )
                )
            cut = any(t.error == CUT for t in timings)
            errors = sorted({t.error for t in timings if not t.success})[:5]
            runs.append(
                {
                    "concurrency": conc,
                    "metrics": m,
                    "roofline": roof,
                    "gpu_util_pct": gpu.mean(),
                    "engine_steps": steps,
                    "errors": errors,
                    "cut": cut,
                }
            )
            result = build_result(args, name, shape_name, runs, startup, waited, str(device))
            if not args.no_save:
                result["path"] = str(save_result(result, args.output_json))
    finally:
        if server is not None:
            server.stop()
    if not runs:
        raise RuntimeError("no level ran before the sweep deadline")
    lost = [r for r in runs if r["metrics"].get("incomplete")]
    if args.sweep_concurrency:
        print(result["results"]["table"])
        if result["results"]["targets"]:
            print(targets_table(result["results"]["targets"]))
    if "path" in result:
        print(f"saved {result['path']}")
    if lost:
        m = lost[0]["metrics"]
        raise IncompleteRun(
            f"serve at concurrency {lost[0]['concurrency'] or 'unlimited'} ({len(lost)} of {len(runs)} levels "
            "incomplete; the others' figures are saved)",
            m["completed"],
            m["completed"] + m["failed"],
            lost[0]["errors"],
        )
    return result


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through `finally`, which stops the server


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    exit_on_incomplete(main)
