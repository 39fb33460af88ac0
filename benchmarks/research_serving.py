"""Serving with part of the requests capturing activations or steering: what research costs the batch.

    python -m benchmarks.research_serving --shape-model llama-3.1-8b \
        --launch "jaxllm serve llama-3.1-8b --load-format dummy --enable-research-api --port 8000" \
        --concurrency 32 --num-prompts 256 --capture-fraction 0.1 --steer-fraction 0.1 --output-json FILE

    [--launch: the server, timed to /health]
    probe, one request at a time: a plain one, one capturing --capture-layers residual sites (the shapes
        that come back are checked: positions x hidden size), and the plain one again under a strong
        steer (it must change the greedy tokens: the server applies steering)
    warm-up: --warmup-prompts requests, as mixed as the timed run (research variants of the step compile)
    timed runs at --concurrency, --repeats times each, alternating, each on fresh random prompts:
      none:     every request plain (ignore_eos, --output-len tokens)
      research: the same lengths; --capture-fraction of them capture the residual stream at
                --capture-layers layers spread over the model (capture_positions --capture-positions),
                --steer-fraction others add a random unit vector times --steer-scale at the middle layer
    -> median / p99 TPOT per run and per group (plain, capture, steer rows), output tok/s, and the ratio
       research/none of the median TPOT (the target: within 5%), from each pair and from all runs

Every request asks for the same number of tokens (ignore_eos), so the runs differ only in research.
Captures stream with each chunk (base64 arrays): the client reads them like any chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import statistics
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.finished import exit_on_incomplete, require_all_finished
from benchmarks.serve import _stop_on_sigterm, model_from_launch, run_load, served_model
from benchmarks.serve_metrics import serving_metrics
from benchmarks.server_process import launch_server, wait_for_background_compiles
from benchmarks.structured_serving import group_metrics, per_step_ms, ratio, step_metrics
from benchmarks.workload import BenchRequest, hf_config_for_model, make_result, random_requests, save_result

RUNS = ("none", "research")
TPOT_TARGET = 1.05  # the research run's median TPOT at most 5% above the plain run's
PROBE_PROMPT_LEN, PROBE_TOKENS = 12, 8
GOLDEN = (5**0.5 - 1) / 2
STRONG_STEER = 1e3  # the probe's scale: far beyond the residual stream's norm


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Serving with a fraction of requests capturing or steering.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", default=None, help='start this server command first ("jaxllm serve ...")')
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--server-log", default=None)
    p.add_argument("--model", default=None, help="model name to send; default: the first of /v1/models")
    p.add_argument(
        "--shape-model", default=None, help="preset or HF folder (layers, hidden size, vocabulary)"
    )
    p.add_argument("--num-prompts", type=int, default=256, help="requests per run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--capture-fraction", type=float, default=0.1)
    p.add_argument("--steer-fraction", type=float, default=0.1)
    p.add_argument(
        "--capture-layers", type=int, default=4, help="residual sites each capturing request asks for"
    )
    p.add_argument("--capture-positions", default="all", choices=("all", "prompt", "generated"))
    p.add_argument("--steer-scale", type=float, default=4.0, help="times a random unit vector")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each kind, alternating")
    p.add_argument("--warmup-prompts", type=int, default=64)
    p.add_argument("--compile-wait-s", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--name", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    return p


# ---- requests -------------------------------------------------------------------------------------------
def spread_layers(num_layers: int, count: int) -> list[int]:
    """`count` distinct layers spread evenly over [0, num_layers), the last one included."""
    if not 1 <= count <= num_layers:
        raise ValueError(f"--capture-layers={count} must be in [1, {num_layers}]")
    return sorted(
        {round(k * (num_layers - 1) / max(1, count - 1)) for k in range(count)} if count > 1 else {0}
    )


def research_groups(n: int, capture_fraction: float, steer_fraction: float) -> tuple[list[int], list[int]]:
    """Which of n requests capture and which steer: disjoint, spread evenly over the run (request i falls
    at frac(i * golden ratio) in [0, 1): below capture_fraction it captures, in the next steer_fraction
    it steers)."""
    for name, f in (("capture", capture_fraction), ("steer", steer_fraction)):
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"--{name}-fraction={f} must be in [0, 1]")
    if capture_fraction + steer_fraction > 1.0:
        raise ValueError("--capture-fraction plus --steer-fraction must be at most 1")
    x = np.modf(np.arange(n) * GOLDEN)[0]
    capture = np.flatnonzero(x < capture_fraction).tolist()
    steer = np.flatnonzero((x >= capture_fraction) & (x < capture_fraction + steer_fraction)).tolist()
    return capture, steer


def capture_body(layers: list[int], positions: str) -> dict[str, Any]:
    return {"research": {"capture": [f"residual.{i}" for i in layers], "capture_positions": positions}}


def steer_body(site: str, vector: np.ndarray, scale: float) -> dict[str, Any]:
    return {"research": {"steer": [{"site": site, "vector": vector.tolist(), "scale": scale}]}}


def unit_vector(hidden: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(hidden)
    return (v / np.linalg.norm(v)).astype(np.float32)


def research_requests(
    base: list[BenchRequest], capture: list[int], steer: list[int], capture_extra: dict, steer_extra: dict
) -> list[BenchRequest]:
    out = list(base)
    for idx, extra in ((capture, capture_extra), (steer, steer_extra)):
        for i in idx:
            r = base[i]
            out[i] = BenchRequest(r.prompt, r.input_len, r.output_len, extra)
    return out


# ---- the probe ------------------------------------------------------------------------------------------
def probe(
    url: str, model: str, prompt: list[int], layers: list[int], hidden: int, site: str, vector: np.ndarray
) -> dict:
    """Plain, capturing and steered requests one at a time: the server must serve research and steer."""

    def complete(extra: dict | None) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0.0}
        body["ignore_eos"] = True
        resp = httpx.post(url + "/v1/completions", json={**body, **(extra or {})}, timeout=600.0)
        if resp.status_code != 200:
            raise RuntimeError(
                f"probe request failed (does the server run --enable-research-api?): {resp.text}"
            )
        return resp.json()["choices"][0]

    from jaxllm.research_wire import decode_captures

    plain = complete(None)
    captured = decode_captures(complete(capture_body(layers, "all"))["research"])
    expected = (len(prompt) + PROBE_TOKENS - 1, hidden)  # every prompt position and each sampled token's
    shapes = {site: list(a.shape) for site, a in captured.arrays.items()}
    if sorted(shapes) != sorted(f"residual.{i}" for i in layers) or any(
        tuple(s) != expected for s in shapes.values()
    ):
        raise RuntimeError(f"captures came back as {shapes}, expected {expected} at each requested layer")
    # The steer must reach the model: the last layer's residual stream over the prompt (positions that
    # do not depend on the sampled tokens), captured with and without a strong steer, must differ by far
    # more than rounding.
    last = {"capture": [f"residual.{layers[-1]}"], "capture_positions": "prompt"}
    plain_last = decode_captures(complete({"research": last})["research"]).arrays[last["capture"][0]]
    steer = steer_body(site, vector, STRONG_STEER)["research"]
    steered_last = decode_captures(complete({"research": {**last, **steer}})["research"]).arrays[
        last["capture"][0]
    ]
    moved = float(np.max(np.abs(steered_last.astype(np.float32) - plain_last.astype(np.float32))))
    return {
        "capture_shapes": shapes,
        "plain_tokens_again": complete(None)["text"] == plain["text"],
        "steer_moved_last_residual": moved,
        "steer_applied": moved > 1.0,
    }


# ---- the run --------------------------------------------------------------------------------------------
def summary_table(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| run | requests ok | median TPOT ms | p99 TPOT ms | median TTFT ms | output tok/s | "
        "plain rows | capture rows | steer rows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        m, g = r["metrics"], r.get("groups") or {}
        cells = [f"{g[k]['median_tpot_ms']:.2f}" if g.get(k) else "-" for k in ("plain", "capture", "steer")]
        lines.append(
            f"| {name} | {m['completed']}/{m['completed'] + m['failed']} | {m['median_tpot_ms']:.2f} | "
            f"{m['p99_tpot_ms']:.2f} | {m['median_ttft_ms']:.1f} | {m['output_throughput']:,.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    shape_name = args.shape_model or model_from_launch(args.launch) or args.model
    cfg = hf_config_for_model(shape_name)
    vocab, hidden, num_layers = int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    layers = spread_layers(num_layers, args.capture_layers)
    capture_idx, steer_idx = research_groups(args.num_prompts, args.capture_fraction, args.steer_fraction)
    capture_extra = capture_body(layers, args.capture_positions)
    steer_site, steer_vector = f"residual.{num_layers // 2}", unit_vector(hidden, args.seed)
    steer_extra = steer_body(steer_site, steer_vector, args.steer_scale)

    server, ready_s = None, None
    if args.launch:
        server = launch_server(args.launch, args.base_url, args.launch_timeout, log_path=args.server_log)
        ready_s = server.ready_s
        print(f"server ready in {ready_s:.1f} s (log: {server.log_path})")
    runs: dict[str, dict[str, Any]] = {}
    try:
        model = args.model or served_model(args.base_url)

        def load(reqs: list[BenchRequest]):
            return asyncio.run(
                run_load(
                    args.base_url,
                    model,
                    reqs,
                    math.inf,
                    args.concurrency,
                    0.0,
                    args.seed,
                    args.request_timeout,
                )
            )

        prompt = random_requests(1, PROBE_PROMPT_LEN, 1, vocab, 0.0, args.seed + 100)[0].prompt
        checks = probe(args.base_url, model, prompt, layers, hidden, steer_site, steer_vector)
        print(f"probe: {checks}")
        if args.warmup_prompts:
            warm = random_requests(
                args.warmup_prompts, args.input_len, args.output_len, vocab, 0.0, args.seed + 200
            )
            cap, st = research_groups(len(warm), args.capture_fraction, args.steer_fraction)
            _, secs = load(research_requests(warm, cap, st, capture_extra, steer_extra))
            print(f"warm-up: {len(warm)} requests in {secs:.1f} s (not counted)")
        waited = None
        if args.compile_wait_s > 0:
            status = wait_for_background_compiles(args.base_url, args.compile_wait_s)
            waited = None if status is None else status[0]

        plain_idx = sorted(set(range(args.num_prompts)) - set(capture_idx) - set(steer_idx))
        errors: dict[str, set] = {}
        for rep in range(args.repeats):
            for k, kind in enumerate(RUNS):
                seed = args.seed + 1000 * (rep + 1) + k
                base = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, 0.0, seed)
                reqs = (
                    base
                    if kind == "none"
                    else research_requests(base, capture_idx, steer_idx, capture_extra, steer_extra)
                )
                steps0 = step_metrics(args.base_url)
                timings, secs = load(reqs)
                steps1 = step_metrics(args.base_url)
                runs[f"{kind}-{rep}"] = {
                    "metrics": serving_metrics(timings, secs),
                    "per_step": per_step_ms(steps0, steps1),
                    "groups": {
                        "plain": group_metrics(timings, plain_idx, secs),
                        "capture": group_metrics(timings, capture_idx, secs) if kind == "research" else None,
                        "steer": group_metrics(timings, steer_idx, secs) if kind == "research" else None,
                    },
                }
                errors.setdefault(kind, set()).update(t.error for t in timings if not t.success)
    finally:
        if server is not None:
            server.stop()
    for run_name, r in runs.items():  # no figures from a run that lost requests
        require_all_finished(
            f"research_serving run {run_name}",
            r["metrics"]["completed"],
            r["metrics"]["completed"] + r["metrics"]["failed"],
        )

    med = {name: r["metrics"]["median_tpot_ms"] for name, r in runs.items()}
    pairs = [ratio(med[f"research-{rep}"], med[f"none-{rep}"]) for rep in range(args.repeats)]
    overall = ratio(
        statistics.median(med[f"research-{rep}"] for rep in range(args.repeats)),
        statistics.median(med[f"none-{rep}"] for rep in range(args.repeats)),
    )
    tpot = {"research_vs_none": overall, "per_repeat": pairs, "target": TPOT_TARGET}
    tpot["target_met"] = None if overall is None else overall <= TPOT_TARGET
    table = summary_table(runs)
    results = {
        "runs": runs,
        "tpot_ratio": tpot,
        "probe": checks,
        "research": {
            "capture_requests": len(capture_idx),
            "steer_requests": len(steer_idx),
            "capture_sites": capture_extra["research"]["capture"],
            "capture_positions": args.capture_positions,
            "steer_site": steer_extra["research"]["steer"][0]["site"],
        },
        "errors": {k: sorted(v)[:5] for k, v in errors.items()},
        "table": table,
    }
    name = args.name or f"research-serving-{Path(str(shape_name)).name}-c{args.concurrency}"
    result = make_result(
        "research-serving",
        name,
        shape_name,
        vars(args),
        results,
        None,
        server_ready_s=ready_s,
        background_compile_wait_s=waited,
    )
    print(table)
    print(f"median TPOT research/none {overall:.3f} (target <= {TPOT_TARGET}); per repeat {pairs}")
    if not args.no_save:
        result["path"] = str(save_result(result, args.output_json))
        print(f"saved {result['path']}")
    return result


if __name__ == "__main__":
    import logging

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    exit_on_incomplete(main)
