"""Perplexity of a model on a fixed text, through the engine: what quantization costs in accuracy.

    text: the docstrings of a fixed list of standard-library modules (every Python 3.12 install has them;
          English prose with some code), tokenized by the model's tokenizer
      -> windows of --window tokens (each starting with BOS when the tokenizer has one)
      -> LLM.generate(prompt_logprobs=0, max_tokens=1): the log-probability of each prompt token given
         the ones before it, computed by the engine (its kernels, its quantized layers, its KV cache)
      -> perplexity = exp(-mean log p) over every scored token, per configuration

    python -m benchmarks.perplexity --config bf16: --config fp8:quantization=fp8 \
        --config fp8kv:kv_cache_dtype=fp8 --config awq:model=/path/to/awq-checkpoint

A configuration is NAME:key=value,key=value (LLM keyword arguments; model= may name another checkpoint
of the same model). The first configuration is the reference the others are compared with.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import time
from typing import Any

from benchmarks.workload import make_result, save_result

TEXT_MODULES = (
    "pdb", "re", "socketserver", "statistics", "wave", "site", "csv", "json", "argparse", "cmd", "hashlib",
    "timeit", "unittest", "copy", "uuid", "heapq", "itertools", "inspect", "struct", "sched", "doctest",
    "subprocess",
)  # fmt: skip


def reference_text() -> str:
    return "\n\n".join((importlib.import_module(m).__doc__ or "").strip() for m in TEXT_MODULES)


def parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = int(value) if value.isdigit() else value
    return name, kwargs


def windows(ids: list[int], window: int, bos: int | None, max_windows: int | None) -> list[list[int]]:
    step = window - (1 if bos is not None else 0)
    out = []
    for start in range(0, len(ids) - 1, step):
        chunk = ids[start : start + step]
        if len(chunk) < 2:
            break
        out.append(([bos] if bos is not None else []) + chunk)
    return out[:max_windows] if max_windows else out


def perplexity(llm, prompts: list[list[int]]) -> tuple[float, int]:
    from jaxllm import SamplingParams

    outs = llm.generate(
        None, SamplingParams(max_tokens=1, prompt_logprobs=0), prompt_token_ids=prompts, use_tqdm=False
    )
    total, count = 0.0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        for token, position in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
            total += position[token].logprob
            count += 1
    return math.exp(-total / count), count


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default model of the configurations (default: embedded)")
    p.add_argument("--config", action="append", required=True, help="NAME:key=value,... (LLM kwargs)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--name", default="perplexity")
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    from jaxllm import LLM

    rows = []
    text = reference_text()
    for spec in args.config:
        name, kwargs = parse_config(spec)
        kwargs.setdefault("model", args.model)
        kwargs.setdefault("max_model_len", args.window + 1)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        tok = llm.get_tokenizer()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        prompts = windows(ids, args.window, tok.bos_token_id, args.max_windows)
        ppl, count = perplexity(llm, prompts)
        info = llm.llm_engine.startup_info
        rows.append(
            {
                "name": name,
                "kwargs": kwargs,
                "perplexity": round(ppl, 4),
                "tokens": count,
                "quantization": info.get("quantization"),
                "kv_cache_dtype": info.get("kv_cache_dtype"),
                "weight_bytes": info.get("weight_bytes"),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        del llm
        gc.collect()
        ref = rows[0]["perplexity"]
        rows[-1]["vs_reference"] = round(rows[-1]["perplexity"] / ref - 1.0, 4)
        print(rows[-1], flush=True)
    print(f"{'config':<14} {'perplexity':>10} {'vs ' + rows[0]['name']:>10} {'weights MiB':>12}")
    for r in rows:
        wb = (r["weight_bytes"] or 0) / 2**20
        print(f"{r['name']:<14} {r['perplexity']:>10.4f} {r['vs_reference'] * 100:>+9.2f}% {wb:>12.1f}")
    result = make_result(
        "perplexity", args.name, args.model, vars(args), {"rows": rows, "text_modules": TEXT_MODULES}, None
    )
    if not args.no_save:
        print("saved", save_result(result, args.output_json))
    return result


if __name__ == "__main__":
    main()
