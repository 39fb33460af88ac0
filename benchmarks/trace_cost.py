"""Host time to trace and lower every model-step variant a server compiles at start, per layer-trace mode.

    python -m benchmarks.trace_cost --model llama-3.1-8b --max-num-seqs 1024 --max-num-batched-tokens 8192

Both run under the GIL before an executable is compiled or loaded from the persistent cache, once per
bucket of the start-up plan (runner/buckets.py). `plain`: every layer traced as itself;
`once`: the layers share one trace (jaxllm/models/layer_trace.py). Abstract bfloat16 weights, so any
model size runs on the CPU. Lowering targets CUDA; with the `pallas` backend it needs a GPU (the Triton
lowering asks for one), so on a CPU `--backend reference` times both and `pallas` only the trace. The
lowered programs of the two modes are compared and must be the same text.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.workload import arch_for_model, make_result, save_result  # noqa: E402
from jaxllm.layers.attention_metadata import AttentionMetadata  # noqa: E402
from jaxllm.models.registry import abstract_params, build_model  # noqa: E402
from jaxllm.runner.buckets import BucketPlan  # noqa: E402


def time_mode(arch, backend: str, shapes, once: bool, lower: bool, num_blocks: int, block_size: int):
    jax.clear_caches()
    module = dataclasses.replace(build_model(arch, backend), trace_layers_once=once)
    params = abstract_params(module, jnp.bfloat16)
    sds = jax.ShapeDtypeStruct
    kv = [
        (sds((arch.num_kv_heads, num_blocks, block_size, arch.head_dim), jnp.bfloat16),) * 2
        for _ in range(arch.num_layers)
    ]

    def step(params, ids, kv, md, rows):
        hidden, kv = module.apply({"params": params}, ids, kv, md)
        return module.apply({"params": params}, hidden[rows], method="compute_logits"), kv

    f = jax.jit(step, donate_argnums=(2,))
    rows = []
    for t, s, b in shapes:
        i32 = lambda *shape: sds(shape, jnp.int32)  # noqa: E731
        md = AttentionMetadata(i32(t), i32(t), i32(s, b), i32(s), i32(s + 1), i32(1))
        t0 = time.perf_counter()
        traced = f.trace(params, i32(t), kv, md, i32(s))
        t1 = time.perf_counter()
        row = {"shape": [t, s, b], "trace_s": round(t1 - t0, 4)}
        if lower:
            text = traced.lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
            row["lower_s"] = round(time.perf_counter() - t1, 4)
            row["program_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--backend", default="reference", choices=["reference", "pallas"])
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    arch = arch_for_model(args.model)
    plan = BucketPlan.build(
        args.max_num_batched_tokens,
        args.max_num_seqs,
        -(-args.max_model_len // args.block_size),
        bucket_pages=False,
    )
    shapes = plan.all_shapes()
    lower = args.backend == "reference" or jax.default_backend() == "gpu"
    modes = {}
    for name, once in (("plain", False), ("once", True)):
        rows = time_mode(arch, args.backend, shapes, once, lower, args.num_blocks, args.block_size)
        total = sum(r["trace_s"] + r.get("lower_s", 0.0) for r in rows)
        modes[name] = {
            "variants": rows,
            "total_s": round(total, 3),
            "median_trace_s": round(statistics.median(r["trace_s"] for r in rows), 4),
            "median_lower_s": round(statistics.median(r["lower_s"] for r in rows), 4) if lower else None,
        }
        print(f"{name:5s}: {len(rows)} variants, trace + lower {total:.2f} s "
              f"(median trace {modes[name]['median_trace_s']:.3f} s)", flush=True)  # fmt: skip
    same = None
    if lower:
        same = all(
            a["program_sha256"] == b["program_sha256"]
            for a, b in zip(modes["plain"]["variants"], modes["once"]["variants"], strict=True)
        )
        print(f"same programs in both modes: {same}")
    saved = modes["plain"]["total_s"] - modes["once"]["total_s"]
    print(
        f"saved {saved:.2f} s of GIL-held start-up work ({modes['once']['total_s'] / modes['plain']['total_s']:.2f}x)"
    )
    result = make_result(
        "trace_cost",
        f"trace-cost-{args.model}-{args.backend}",
        args.model,
        vars(args),
        {"modes": modes, "same_programs": same, "saved_s": round(saved, 3)},
        None,
    )
    print(f"saved to {save_result(result, args.output_json)}")
    return 0 if same is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
