"""Quantized serving speed against bf16 in the same process: single-stream decode and offline throughput.

    for each --methods entry (bf16, fp8, awq, gptq, compressed-tensors: random weights of that layout at
    the model's real size, --load-format dummy; METHOD@KV gives that entry its own --kv-cache-dtype,
    e.g. fp8@fp8 for FP8 weights with an FP8 KV cache; +KNOB or +KNOB=INT after an int4 method sets a
    knob of the one-row GEMV kernel for that entry, e.g. awq+pipeline or awq+pipeline+num_stages=4):
      LLM(...) -> weight bytes and KV blocks at load (the engine's startup_info)
      concurrency 1: one --input-len prompt, generate 1 token (prefill) and 1 + --decode-tokens tokens;
                     decode tok/s = decode tokens / (the difference); best of --decode-reps
                     bound: the card's bandwidth / (weight bytes + the KV bytes a step reads)
      offline (methods in --offline-methods): --num-prompts x --input-len -> --output-len, every request
                     handed to generate at once (ignore_eos) -> output tok/s
    -> speed-ups over bf16 (the first method) and each method's share of its own bound

    python -m benchmarks.quantized_speed --model llama-3.1-8b --methods bf16,fp8,fp8@fp8,awq \
        --offline-methods bf16,fp8,fp8@fp8 --num-prompts 1000 --input-len 512 --output-len 256
    python -m benchmarks.quantized_speed --methods bf16,awq,awq+pipeline,awq,awq+pipeline --offline-methods ''

Entries may repeat: alternating two kernels' entries in one process shows the card's drift beside their
difference (a GEMV knob's default is what jaxllm/kernels/w4a16_gemv.py's default_gemv_config returns).

Random weights decide nothing here: a GEMM reads the same bytes whatever they hold. The bound is that of
the card JAX runs on (roofline.py; none on a card without peaks). A method whose generate left a request
unfinished gets an error row instead of figures, and the run exits 1 (finished.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import time
from typing import Any

import jax

from benchmarks.finished import IncompleteRun, exit_on_incomplete, require_all_finished
from benchmarks.roofline import HARDWARE_CHOICES, hardware_for_device
from benchmarks.workload import arch_for_model, make_result, random_requests, save_result

logger = logging.getLogger("jaxllm.benchmarks")
METHODS = {
    "bf16": None,
    "fp8": "fp8",
    "awq": "awq",
    "gptq": "gptq",
    "compressed-tensors": "compressed-tensors",
}
INT4_METHODS = ("awq", "gptq", "compressed-tensors")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="llama-3.1-8b", help="preset or HF folder (random weights of its shape)"
    )
    p.add_argument(
        "--methods",
        default="bf16,fp8,awq",
        help=f"comma-separated, from {', '.join(METHODS)}; METHOD@KV sets that entry's KV cache dtype; "
        "an int4 METHOD+KNOB[=INT] sets a GEMV kernel knob (w4a16_gemv.GEMV_KNOBS) for that entry",
    )
    p.add_argument("--offline-methods", default="bf16,fp8", help="the methods also run offline ('' for none)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--decode-reps", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-dtype", default="auto", help="for entries without @KV")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hardware", default="auto", choices=HARDWARE_CHOICES)
    p.add_argument("--name", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    return p


def _generate_seconds(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds of one generate; IncompleteRun unless every request produced its max_tokens."""
    from jaxllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(None, sp, prompt_token_ids=prompts, use_tqdm=False)
    seconds = time.perf_counter() - t0
    done = sum(o.finished and len(o.outputs[0].token_ids) == max_tokens for o in outs)
    require_all_finished("generate", done, len(prompts))
    return seconds


def parse_method(entry: str, default_kv: str) -> tuple[str, str, dict]:
    """'METHOD[@KV_CACHE_DTYPE][+KNOB[=INT]]...' -> (method, kv cache dtype, GEMV knobs); SystemExit
    naming a bad entry."""
    from jaxllm.kernels.w4a16_gemv import GEMV_KNOBS

    head, *knob_parts = entry.split("+")
    method, _, kv = head.partition("@")
    if method not in METHODS:
        raise SystemExit(f"--methods: {method!r} (in {entry!r}) is not one of {', '.join(METHODS)}")
    knobs: dict[str, Any] = {}
    for part in knob_parts:
        name, eq, value = part.partition("=")
        if method not in INT4_METHODS:
            raise SystemExit(f"--methods: {entry!r}: GEMV knobs apply to {', '.join(INT4_METHODS)} only")
        if name not in GEMV_KNOBS:
            raise SystemExit(f"--methods: {entry!r}: {name!r} is not one of {', '.join(GEMV_KNOBS)}")
        if not eq:
            knobs[name] = True
        elif value.isdigit():
            knobs[name] = int(value)
        else:
            raise SystemExit(f"--methods: {entry!r}: {part!r} needs a whole number after '='")
    return method, kv or default_kv, knobs


@contextlib.contextmanager
def gemv_defaults(knobs: dict):
    """The one-row W4A16 kernel's defaults updated with `knobs` while an entry runs. Its jitted function
    caches traces by its static arguments, which the layers leave unset, so its cache is cleared on the
    way in and out: an entry's step never reuses another entry's trace."""
    from jaxllm.kernels import w4a16_gemv as gemv

    if not knobs:
        yield
        return
    base = gemv.default_gemv_config
    gemv.default_gemv_config = lambda *shape: {**base(*shape), **knobs}
    gemv.w4a16_gemv.clear_cache()
    try:
        yield
    finally:
        gemv.default_gemv_config = base
        gemv.w4a16_gemv.clear_cache()


def run_method(entry: str, args, vocab: int, hw, offline: bool) -> dict[str, Any]:
    method, kv_cache_dtype, knobs = parse_method(entry, args.kv_cache_dtype)
    with gemv_defaults(knobs):
        return _run_method(entry, method, kv_cache_dtype, args, vocab, hw, offline)


def _run_method(entry: str, method: str, kv_cache_dtype: str, args, vocab: int, hw, offline: bool) -> dict:
    from jaxllm import LLM

    llm = LLM(
        model=args.model,
        load_format="dummy",
        quantization=METHODS[method],
        max_model_len=args.max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    info = dict(llm.llm_engine.startup_info)
    row: dict[str, Any] = {
        "method": entry,
        "quantization": info.get("quantization"),
        "weight_gib": info.get("weight_gib"),
        "weight_bytes": info["weight_bytes"],
        "num_gpu_blocks": info["num_gpu_blocks"],
        "kv_cache_gib": info["kv_cache_gib"],
        "kv_cache_dtype": info["kv_cache_dtype"],
        "startup_time_s": info["startup_time_s"],
    }
    prompt = random_requests(1, args.input_len, 1, vocab, seed=1)[0].prompt
    _generate_seconds(llm, [prompt], 1 + args.decode_tokens)  # warm-up: every shape of the timed calls
    best = float("inf")
    for _ in range(args.decode_reps):
        t_prefill = _generate_seconds(llm, [prompt], 1)
        t_full = _generate_seconds(llm, [prompt], 1 + args.decode_tokens)
        best = min(best, (t_full - t_prefill) / args.decode_tokens)
    row["decode_tpot_ms"] = round(best * 1e3, 3)
    row["decode_tok_s"] = round(1.0 / best, 1)
    # a decode step reads every weight (the embedding table only through the tied head, if tied) and
    # the KV of the context so far
    kv_bytes_per_token = info["kv_cache_gib"] * 2**30 / (info["num_gpu_blocks"] * info["block_size"])
    context = args.input_len + args.decode_tokens / 2
    step_bytes = info["weight_bytes"] + kv_bytes_per_token * context
    if hw is not None:
        row["decode_bound_tok_s"] = round(hw.bandwidth / step_bytes, 1)
        row["decode_share_of_bound"] = round(row["decode_tok_s"] / row["decode_bound_tok_s"], 3)
    if offline:
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, seed=2)
        _generate_seconds(llm, [r.prompt for r in reqs[:64]], args.output_len)  # warm-up
        wall = _generate_seconds(llm, [r.prompt for r in reqs], args.output_len)
        row["offline_wall_s"] = round(wall, 2)
        row["offline_output_tok_s"] = round(args.num_prompts * args.output_len / wall, 1)
    del llm
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    methods = [m for m in args.methods.split(",") if m]
    offline = {m for m in args.offline_methods.split(",") if m}
    for m in methods:
        parse_method(m, args.kv_cache_dtype)
    vocab = arch_for_model(args.model).vocab_size
    device = jax.devices()[0].device_kind
    hw = hardware_for_device(args.hardware, device)
    rows, incomplete = [], []
    for m in methods:
        try:
            rows.append(run_method(m, args, vocab, hw, m in offline))
        except IncompleteRun as e:  # no figures for this method; the run fails once the others are saved
            incomplete.append((m, e))
            rows.append({"method": m, "error": str(e)})
        except Exception as e:  # one layout failing must not hide the others' figures
            logger.exception("method %s failed", m)
            rows.append({"method": m, "error": f"{type(e).__name__}: {e}"})
        print(rows[-1], flush=True)
    base = rows[0] if "error" not in rows[0] else None
    for row in rows[1:]:
        if base and "error" not in row:
            row["decode_speedup"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
            if "offline_output_tok_s" in row and "offline_output_tok_s" in base:
                row["offline_speedup"] = round(row["offline_output_tok_s"] / base["offline_output_tok_s"], 3)
    bound = f"{hw.name} bound {hw.bandwidth / 1e12:.2f} TB/s" if hw else "no bound known for this card"
    print(f"{args.model} on {device} ({bound}):")
    for row in rows:
        print("  ", {k: v for k, v in row.items() if k not in ("quantization",)})
    result = make_result(
        "quantized_speed",
        args.name or f"quantized-speed-{args.model}",
        args.model,
        vars(args),
        {"rows": rows},
        None,
        device=device,
        hardware=hw.name if hw else None,
        bandwidth_bytes_per_s=hw.bandwidth if hw else None,
    )
    if not args.no_save:
        print("saved", save_result(result, args.output_json))
    if incomplete:
        m, e = incomplete[0]
        raise IncompleteRun(
            f"quantized_speed, method {m} (of {len(incomplete)} incomplete)", e.finished, e.total
        )
    return result


if __name__ == "__main__":
    exit_on_incomplete(main)
