"""Offline throughput, as vLLM's benchmark_throughput: every request handed to `LLM.generate` at once.

    args --model shape (no weights)--> --workload random | shared-prefix | chat token-id requests
         (workload.py; or --dataset JSONL)
         [--peer transformers: child process, before JAX takes the GPU]
         --LLM(...)--> startup_info --generate(ignore_eos)--> wall time, tokens; every request finished?
         --offline_bound (on JAX's card; the prefix a cache can supply left out)--> roofline line
         --save_result--> benchmarks/results/<date>-<device>-<name>.json

    python -m benchmarks.throughput --model llama-3.1-8b --load-format dummy --num-prompts 1000 \
        --input-len 512 --output-len 256 --name llama8b-1000x512x256

Reported: requests/s, output tok/s, total tok/s, wall time of generate, engine startup time, the prefix
cache's hit rate, the share of the roofline bound for this exact workload on the card JAX runs on
(roofline.py; none on a card it has no peaks for), and with --peer the ratio of each figure to the peer's.
A run in which a request did not finish (or a peer run that did not) reports no throughput and exits 1
(finished.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.finished import IncompleteRun, exit_on_incomplete, require_all_finished
from benchmarks.roofline import (
    HARDWARE_CHOICES,
    ModelShape,
    hardware_for_device,
    jax_device_kind,
    no_bound_line,
    offline_bound,
    roofline_line,
)
from benchmarks.workload import (
    BenchRequest,
    add_workload_args,
    arch_for_model,
    cached_prefix_lens,
    hf_config_for_model,
    load_jsonl,
    make_result,
    save_result,
    workload_label,
    workload_requests,
)
from jaxllm.config import ATTENTION_BACKENDS

logger = logging.getLogger("jaxllm.benchmarks")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Offline throughput of jaxllm (vLLM's benchmark_throughput).")
    p.add_argument(
        "--model", default=None, help="preset (with --load-format dummy), HF folder, GGUF; default: embedded"
    )
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ ratio)")
    add_workload_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (greedy) or 1 (sampling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dataset", default=None, help="JSONL: {prompt | prompt_token_ids, [output_len]} per line"
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV blocks, fixed (as vLLM)")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap scheduling with the device step (the engine's default)",
    )
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument(
        "--disable-detokenize", action="store_true", help="token ids only (always so without a tokenizer)"
    )
    p.add_argument("--warmup-prompts", type=int, default=0, help="a small generate before the timed one")
    p.add_argument(
        "--unfreeze-gc",
        action="store_true",
        help="undo the engine's start-up freeze of the garbage collector's heap (jaxllm/engine/heap.py) "
        "before timing: the A/B of that freeze",
    )
    p.add_argument(
        "--device-trace",
        action="store_true",
        help="trace the timed generate with jax.profiler and report the device's busy time and idle gaps "
        "over the run (the trace slows the run: its throughput is not comparable)",
    )
    p.add_argument("--peer", choices=["none", "transformers"], default="none")
    p.add_argument("--peer-timeout", type=float, default=900.0, help="seconds before the peer is given up")
    p.add_argument(
        "--hardware",
        choices=HARDWARE_CHOICES,
        default="auto",
        help="peaks for the roofline (auto: those of the card JAX runs on; none for a card without an entry)",
    )
    p.add_argument("--name", default=None, help="result name; default: <model>-<N>x<in>x<out>")
    p.add_argument(
        "--output-json", default=None, help="path of the result JSON (default under benchmarks/results)"
    )
    p.add_argument("--no-save", action="store_true")
    return p


def build_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    if args.dataset:
        # Text prompts are measured after generation, from the token ids the engine reports.
        return load_jsonl(args.dataset, args.output_len, args.num_prompts)
    return workload_requests(args, args.num_prompts, vocab_size, args.seed)


def run_engine(
    args: argparse.Namespace, requests: list[BenchRequest], primer: BenchRequest | None = None
) -> dict[str, Any]:
    """`primer`: an untimed request sent first (the shared-prefix workload's, which puts the system prompt
    into the prefix cache as a running service has it)."""
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        tensor_parallel_size=args.tensor_parallel_size,
        compilation_cache_dir=args.compilation_cache_dir,
    )
    startup_wall = time.perf_counter() - t0
    if args.unfreeze_gc:
        gc.unfreeze()
    engine = llm.llm_engine
    longest = max(r.input_len + r.output_len for r in requests)
    if longest > engine.max_model_len:
        raise ValueError(
            f"the longest request needs {longest} tokens but max_model_len={engine.max_model_len}; "
            "raise --max-model-len or shorten --input-len/--output-len"
        )

    # A dummy preset has no tokenizer: there is no text to make.
    detokenize = not args.disable_detokenize and engine.tokenizer is not None

    def params(r: BenchRequest):
        return SamplingParams(
            temperature=args.temperature, max_tokens=r.output_len, ignore_eos=True, detokenize=detokenize
        )

    if primer is not None:
        llm.generate(None, [params(primer)], prompt_token_ids=[primer.prompt], use_tqdm=False)
    if args.warmup_prompts > 0:
        warm = requests[: args.warmup_prompts]
        llm.generate([r.prompt for r in warm], [params(r) for r in warm], use_tqdm=False)

    prompts = [r.prompt for r in requests]
    timing = engine.runner.timing
    steps0, wait0, phases0 = timing.steps, timing.wait_s, dict(timing.host_s)
    stats0 = engine.get_stats()
    with device_trace(args.device_trace) as traced:
        t0 = time.perf_counter()
        if all(isinstance(p, list) for p in prompts):
            outs = llm.generate(None, [params(r) for r in requests], prompt_token_ids=prompts, use_tqdm=False)
        else:
            outs = llm.generate(prompts, [params(r) for r in requests], use_tqdm=False)
        elapsed = time.perf_counter() - t0
    steps, wait = timing.steps - steps0, timing.wait_s - wait0
    breakdown = {
        "steps": steps,
        "mean_step_ms": 1e3 * elapsed / max(steps, 1),
        "device_wait_s": round(wait, 3),
        "host_s": round(elapsed - wait, 3),
        "host_share": (elapsed - wait) / elapsed if elapsed > 0 else 0.0,
        # the engine's host phases (schedule, dispatch: inputs + enqueueing the steps, process), s in all
        "host_phases_s": {k: round(v - phases0.get(k, 0.0), 3) for k, v in timing.host_s.items()},
    }
    if args.device_trace:
        breakdown["device_timeline"] = traced.get("timeline") or "no device kernel events in the trace"

    stats = engine.get_stats()
    queries = stats.prefix_cache_queries - stats0.prefix_cache_queries
    hits = stats.prefix_cache_hits - stats0.prefix_cache_hits
    # With ignore_eos a request that finished has produced exactly its max_tokens.
    done = [
        o.finished and len(o.outputs[0].token_ids) == r.output_len
        for o, r in zip(outs, requests, strict=True)
    ]
    require_all_finished(
        "jaxllm",
        sum(done),
        len(requests),
        [
            f"request {i}: finish_reason {outs[i].outputs[0].finish_reason}"
            for i, ok in enumerate(done)
            if not ok
        ],
    )
    in_lens = [len(o.prompt_token_ids) for o in outs]
    out_lens = [len(o.outputs[0].token_ids) for o in outs]
    info = dict(engine.startup_info)
    info["startup_wall_s"] = round(startup_wall, 3)
    info["detokenize"] = detokenize
    return {
        "elapsed_s": elapsed,
        "prompts": [o.prompt_token_ids for o in outs],
        "prefix_cache": {
            "queried_tokens": queries,
            "hit_tokens": hits,
            "hit_rate": hits / queries if queries else 0.0,
        },
        "input_lens": in_lens,
        "output_lens": out_lens,
        "startup": info,
        "step_breakdown": breakdown,
        "arch": engine.loaded.arch,
        "max_num_seqs": info.get("max_num_seqs") or len(requests),
    }


@contextlib.contextmanager
def device_trace(enabled: bool):
    """With `enabled`, a jax.profiler trace around the block; afterwards the dict it yields holds the
    run's device timeline (step_profile.device_timeline)."""
    found: dict[str, Any] = {}
    if not enabled:
        yield found
        return
    import jax

    from benchmarks.step_profile import device_timeline, load_trace

    # Device events only: host and Python tracing slowed the host's side of the run 3.5x (1,000
    # prompts: 30.6 s of host work against 8.2-10.4 s untraced) and so made gaps that are not there.
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 0
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, profiler_options=options):
            yield found
        found["timeline"] = device_timeline(load_trace(Path(tmp)))


def summarize(elapsed: float, in_lens: list[int], out_lens: list[int]) -> dict[str, float]:
    n, n_in, n_out = len(in_lens), sum(in_lens), sum(out_lens)
    return {
        "num_requests": n,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "elapsed_s": round(elapsed, 4),
        "requests_per_s": n / elapsed,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_in + n_out) / elapsed,
    }


def peer_ratios(res: dict[str, Any], peer: dict[str, Any] | None) -> dict[str, float] | None:
    """jaxllm's figure over the peer's, for each offline figure both report; None without a peer figure."""
    if not peer or "error" in peer:
        return None
    keys = ("requests_per_s", "output_tok_s", "total_tok_s")
    return {k: res[k] / peer[k] for k in keys if peer.get(k)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.temperature < 0:
        raise ValueError(f"--temperature={args.temperature} must be >= 0")
    arch = arch_for_model(args.model)
    requests = build_requests(args, arch.vocab_size)
    primer = None
    if args.workload == "shared-prefix" and not args.dataset:
        # One more request of the same system prompt, sent untimed before the others.
        primer, *requests = workload_requests(args, args.num_prompts + 1, arch.vocab_size, args.seed)

    peer = None
    if args.peer == "transformers":
        from benchmarks.peer_transformers import CONTINUOUS, run_peer_subprocess

        if all(isinstance(r.prompt, list) for r in requests):
            logger.info("running the transformers peer on %d requests", len(requests))
            peer = run_peer_subprocess(
                hf_config_for_model(args.model),
                [r.prompt for r in requests],
                [r.output_len for r in requests],
                args.temperature,
                args.peer_timeout,
            )
        else:
            peer = {"peer": CONTINUOUS, "error": "the peer needs token-id prompts"}

    run = run_engine(args, requests, primer)
    res = summarize(run["elapsed_s"], run["input_lens"], run["output_lens"])
    res["workload"] = "dataset " + args.dataset if args.dataset else workload_label(args)
    res["prefix_cache"] = run["prefix_cache"]
    res["step_breakdown"] = run["step_breakdown"]
    res["vs_peer"] = peer_ratios(res, peer)
    startup = run["startup"]
    device = jax_device_kind()
    hw = hardware_for_device(args.hardware, device)
    roof = None
    if hw is not None:
        shape = ModelShape.from_arch(
            run["arch"], startup.get("dtype", "bfloat16"), startup.get("kv_cache_dtype")
        )
        bound = offline_bound(
            shape,
            run["input_lens"],
            run["output_lens"],
            min(run["max_num_seqs"], len(requests)),
            hw,
            cached_lens=cached_prefix_lens(run["prompts"], [primer.prompt] if primer else []),
        )
        line = roofline_line(bound, run["elapsed_s"])
        roof = {**bound.to_dict(), "achieved_share": bound.seconds / run["elapsed_s"], "line": line}

    model_name = args.model or "embedded"
    kind = "" if args.workload == "random" else f"-{args.workload}"
    name = args.name or f"{Path(model_name).name}{kind}-{len(requests)}x{args.input_len}x{args.output_len}"
    result = make_result(
        "throughput", name, args.model, vars(args), res, roof, device=device, startup=startup, peer=peer
    )
    print_report(result)
    if not args.no_save:
        result["path"] = str(save_result(result, args.output_json))
        print(f"saved {result['path']}")
    if peer is not None and "error" in peer:
        # jaxllm's own figures stand (and are saved); the comparison asked for did not happen.
        raise IncompleteRun(
            "the transformers peer", peer.get("num_finished", 0), len(requests), [peer["error"]]
        )
    return result


def print_report(result: dict[str, Any]) -> None:
    r, s = result["results"], result["startup"]
    print(
        f"== throughput: {result['model']} on {result['device']} ({s.get('dtype')}, attention {s.get('attention_backend')})"
    )
    print(
        f"{r['num_requests']} requests, {r['input_tokens']} input + {r['output_tokens']} output tokens "
        f"in {r['elapsed_s']:.3f} s"
    )
    ratio = r.get("vs_peer") or {}

    def vs(key: str) -> str:
        return f" ({ratio[key]:.2f}x the peer)" if key in ratio else ""

    print(
        f"workload: {r.get('workload')}; prefix cache hits {r['prefix_cache']['hit_rate']:.1%} of prompt tokens"
    )
    print(
        f"throughput: {r['requests_per_s']:.2f} requests/s{vs('requests_per_s')}, {r['output_tok_s']:,.1f} output "
        f"tok/s{vs('output_tok_s')}, {r['total_tok_s']:,.1f} total tok/s{vs('total_tok_s')}"
    )
    print(
        f"engine startup: {s.get('startup_wall_s')} s (load {s.get('load_time_s')} s, compile "
        f"{s.get('compile_time_s')} s, {s.get('num_gpu_blocks')} KV blocks)"
    )
    if result.get("peer"):
        p = result["peer"]
        if "error" in p:
            print(f"peer ({p['peer']}): failed: {p['error']}")
        else:
            print(
                f"peer ({p['peer']} {p.get('transformers_version')}, {p.get('dtype')}): {p['output_tok_s']:,.1f} "
                f"output tok/s, {p['total_tok_s']:,.1f} total tok/s over {p.get('generation_span_s') or p['wall_s']} s"
            )
    b = r.get("step_breakdown")
    if b:
        print(
            f"steps: {b['steps']} ({b['mean_step_ms']:.2f} ms each); the host waited on the device {b['device_wait_s']} s "
            f"and worked {b['host_s']} s ({b['host_share']:.0%} of the wall time; with async scheduling that work "
            "overlaps the device's, so waiting means the device was the bottleneck)"
        )
        if b.get("host_phases_s"):
            per = ", ".join(f"{k} {v / max(b['steps'], 1) * 1e3:.2f}" for k, v in b["host_phases_s"].items())
            print(f"host phases per step (ms): {per}")
        t = b.get("device_timeline")
        if isinstance(t, dict):
            print(
                f"device (traced run): busy {t['busy_s']:.2f} s of a {t['span_s']:.2f} s span ({t['busy_share']:.1%}); "
                + ", ".join(
                    f"{v['count']} gaps {k.replace('_', ' ')} ({v['total_s']:.2f} s)"
                    for k, v in t.items()
                    if k.startswith("gaps")
                )
            )
    print(result["roofline"]["line"] if result["roofline"] else no_bound_line(result["device"]))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    exit_on_incomplete(main)
