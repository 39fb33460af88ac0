"""Online benchmark for any OpenAI-compatible server, with vLLM benchmark_serving's metrics.

    [--launch "jaxllm serve ..." -> wait for /health]
    requests (random token ids or --dataset) --arrivals: Poisson at --request-rate (inf: all at once),
        at most --max-concurrency in flight--> streaming POST /v1/completions (ignore_eos, include_usage)
        --per request: TTFT, ITL gaps, E2E latency, token counts--> serving_metrics (+ goodput)
        --offline_bound on the same lengths--> roofline line --> benchmarks/results/<date>-<device>-<name>.json
    --sweep-concurrency 1,8,32: the same requests at each concurrency -> table of TTFT, tok/s, GPU utilization

    python benchmarks/serve.py --launch "jaxllm serve llama-3.1-8b --load-format dummy --port 8000" \
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
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.roofline import HARDWARE, offline_bound, roofline_line, shape_for_model
from benchmarks.serve_metrics import RequestTiming, parse_goodput, serving_metrics
from benchmarks.server_process import GpuMonitor, launch_server
from benchmarks.workload import BenchRequest, load_jsonl, make_result, random_requests, save_result

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
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
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
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--name", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    return p


# ---- one request ---------------------------------------------------------------------------------------
async def send_request(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, temperature: float
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t = RequestTiming(success=False, prompt_len=req.input_len)
    chunks = 0
    usage = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                t.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return t
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage = msg["usage"]
                if not msg.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    t.ttft = now - start
                else:
                    t.itl.append(now - last)
                last = now
                chunks += 1
        t.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        t.error = f"{type(e).__name__}: {e}"
        return t
    t.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        t.prompt_len = int(usage["prompt_tokens"])
    t.success = chunks > 0
    if not t.success:
        t.error = "the stream held no tokens"
    return t


# ---- a load ----------------------------------------------------------------------------------------------
def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none at rate inf."""
    if rate <= 0:
        raise ValueError(f"--request-rate={rate} must be > 0 (inf sends everything at once)")
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n).tolist()


async def run_load(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    rate: float,
    max_concurrency: int | None,
    temperature: float,
    seed: int,
    timeout_s: float,
) -> tuple[list[RequestTiming], float]:
    url = base_url.rstrip("/") + "/v1/completions"
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def one(r: BenchRequest) -> RequestTiming:
            async with sem:
                return await send_request(client, url, model, r, temperature)

        tasks = []
        t0 = time.perf_counter()
        for gap, r in zip(arrival_gaps(len(requests), rate, seed), requests, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(r)))
        timings = await asyncio.gather(*tasks)
        return list(timings), time.perf_counter() - t0


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
def roofline_for(shape, timings: list[RequestTiming], requests, max_batch: int, duration: float, hw):
    if shape is None:
        return None
    ok = [(t, r) for t, r in zip(timings, requests, strict=True) if t.success and t.output_tokens > 0]
    if not ok:
        return None
    in_lens = [t.prompt_len or r.input_len for t, r in ok]
    bound = offline_bound(
        shape, in_lens, [t.output_tokens for t, _ in ok], max(1, min(max_batch, len(ok))), hw
    )
    return {
        **bound.to_dict(),
        "achieved_share": bound.seconds / duration,
        "line": roofline_line(bound, duration),
    }


def print_metrics(m: dict[str, Any], roof: dict | None) -> None:
    print(f"successful requests: {m['completed']} (failed {m['failed']}), duration {m['duration_s']:.2f} s")
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
    print(roof["line"] if roof else "roofline: n/a (model shape unknown; pass --shape-model)")


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| concurrency | mean TTFT (ms) | p99 TTFT (ms) | mean TPOT (ms) | output tok/s | total tok/s | GPU util |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        util = "n/a" if r["gpu_util_pct"] is None else f"{r['gpu_util_pct']:.0f}%"
        lines.append(
            f"| {r['concurrency']} | {r['mean_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['mean_tpot_ms']:.2f} | "
            f"{r['output_throughput']:,.1f} | {r['total_token_throughput']:,.1f} | {util} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    goodput = parse_goodput(args.goodput)
    sweep = [int(x) for x in args.sweep_concurrency.split(",")] if args.sweep_concurrency else None
    if sweep and min(sweep) < 1:
        raise ValueError(f"--sweep-concurrency={args.sweep_concurrency} must list integers >= 1")
    server = launch_server(args.launch, args.base_url, args.launch_timeout) if args.launch else None
    try:
        if server is not None:
            print(f"server ready in {server.ready_s:.1f} s (log: {server.log_path})")
        model = args.model or served_model(args.base_url)
        shape_name = args.shape_model or model_from_launch(args.launch) or model
        shape = shape_for_model(None if shape_name in EMBEDDED_NAMES else shape_name)
        vocab = args.vocab_size or (shape.vocab_size if shape else None)
        if args.dataset:
            requests = load_jsonl(args.dataset, args.output_len, args.num_prompts)
        elif vocab is None:
            raise ValueError("the model's vocabulary is unknown: pass --vocab-size or --shape-model")
        else:
            requests = random_requests(
                args.num_prompts, args.input_len, args.output_len, vocab, args.range_ratio, args.seed
            )
        hw = HARDWARE[args.hardware]
        # One request first, so that a broken setup fails before the timed run.
        probe = BenchRequest(requests[0].prompt, requests[0].input_len, min(4, requests[0].output_len))
        (first,), _ = asyncio.run(
            run_load(
                args.base_url, model, [probe], math.inf, 1, args.temperature, args.seed, args.request_timeout
            )
        )
        if not first.success:
            raise RuntimeError(f"the first request failed: {first.error}")

        levels = sweep or [args.max_concurrency]
        runs = []
        for conc in levels:
            with GpuMonitor() as gpu:
                timings, duration = asyncio.run(
                    run_load(
                        args.base_url,
                        model,
                        requests,
                        args.request_rate,
                        conc,
                        args.temperature,
                        args.seed,
                        args.request_timeout,
                    )
                )
            m = serving_metrics(timings, duration, goodput)
            roof = roofline_for(shape, timings, requests, conc or len(requests), duration, hw)
            errors = sorted({t.error for t in timings if not t.success})[:5]
            print(
                f"== serve: {model} at {args.base_url}, concurrency {conc or 'unlimited'}, rate {args.request_rate}"
            )
            print_metrics(m, roof)
            runs.append(
                {
                    "concurrency": conc,
                    "metrics": m,
                    "roofline": roof,
                    "gpu_util_pct": gpu.mean(),
                    "errors": errors,
                }
            )
    finally:
        if server is not None:
            server.stop()

    name = (
        args.name
        or f"serve-{Path(str(shape_name or model)).name}-{len(requests)}x{args.input_len}x{args.output_len}"
    )
    args_d = {**vars(args), "request_rate": str(args.request_rate)}
    if sweep:
        rows = [
            {
                "concurrency": r["concurrency"],
                "gpu_util_pct": r["gpu_util_pct"],
                **{
                    k: r["metrics"][k]
                    for k in (
                        "mean_ttft_ms",
                        "p99_ttft_ms",
                        "mean_tpot_ms",
                        "output_throughput",
                        "total_token_throughput",
                        "request_throughput",
                    )
                },
                "roofline_share": r["roofline"]["achieved_share"] if r["roofline"] else None,
            }
            for r in runs
        ]
        table = sweep_table(rows)
        print(table)
        result = make_result(
            "serve-sweep",
            name,
            shape_name,
            args_d,
            {"sweep": rows, "table": table, "runs": runs},
            runs[-1]["roofline"],
            server_ready_s=server.ready_s if server else None,
        )
    else:
        r = runs[0]
        result = make_result(
            "serve",
            name,
            shape_name,
            args_d,
            {**r["metrics"], "gpu_util_pct": r["gpu_util_pct"], "errors": r["errors"]},
            r["roofline"],
            server_ready_s=server.ready_s if server else None,
        )
    if not args.no_save:
        result["path"] = str(save_result(result, args.output_json))
        print(f"saved {result['path']}")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    main()
