"""Runs in a fresh process (jax must start with several host devices): engine cases -> JSON on stdout.

    python tests/parallel/tp_worker.py single CASES_JSON   one process, 8 fake CPU devices
    python tests/parallel/tp_worker.py multi CASE_JSON     one of several processes (jax.distributed)

A case is {"name", "model" (folder), "tp": [sizes], "engine": {more LLM(...) arguments}}; each result row holds the greedy token ids, the
top logprobs of every generated token, per-device parameter bytes, the KV cache layout and the shapes of
the quantized layers' leaves and their shards. The `errors`
section tries bad tensor_parallel_size values and records the ValueError messages.
"""

from __future__ import annotations

import json
import sys

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
ENGINE_KW = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    compile_ahead=False,
    compilation_cache_dir="",
)


def run_case(model: str, tp: int, role: str = "replay", **kw) -> dict:
    """role "replay": generate here; "lead": generate and publish each step; "follow": replay the leader."""
    import jax

    from jaxllm import LLM, SamplingParams
    from jaxllm.parallel.follower import follow, lead

    llm = LLM(model, tensor_parallel_size=tp, **ENGINE_KW, **kw)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True, detokenize=False)
    outs, steps = [], 0
    if role == "follow":
        steps = follow(engine)
    else:
        channel = lead(engine) if role == "lead" else None
        outs = llm.generate([list(p) for p in PROMPTS], sp, use_tqdm=False)
        if channel is not None:
            steps = channel.step
            channel.stop()
    per_device: dict[str, int] = {}
    total = 0
    params = {"/".join(str(getattr(k, "key", k)) for k in path): x for path, x in
              jax.tree_util.tree_leaves_with_path(engine.runner.params)}  # fmt: skip
    replicated, replicated_bytes = [], 0
    for path, x in params.items():
        total += x.nbytes
        if x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1:
            replicated.append(path)
            replicated_bytes += x.nbytes
        for shard in x.addressable_shards:
            per_device[str(shard.device.id)] = per_device.get(str(shard.device.id), 0) + shard.data.nbytes
    k_pages = engine.runner.kv_caches[0][0]
    return {
        "tp": tp,
        "steps": steps,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs
        ],
        "param_bytes_total": total,
        "param_bytes_per_device": per_device,
        "replicated_params": replicated,
        "replicated_bytes": replicated_bytes,
        "qkv_shape": list(params["layers_0/attn/qkv_proj/kernel"].shape)
        if "layers_0/attn/qkv_proj/kernel" in params
        else None,
        "kv_shape": list(k_pages.shape),
        "kv_dtype": str(k_pages.dtype),
        "kv_shard_shape": list(k_pages.addressable_shards[0].data.shape),
        "kv_num_devices": len(k_pages.sharding.device_set),
        # a MoE layer's stacked expert weights: one device's shard
        "expert_shards": {
            path: list(x.addressable_shards[0].data.shape)
            for path, x in params.items()
            if "/experts/" in path
        },
        # a quantized layer's leaves (not "kernel"/"bias"): global shape, one device's shard, dtype
        "quantized_leaves": {
            path: {
                "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape),
                "dtype": str(x.dtype),
            }
            for path, x in params.items()
            if path.startswith("layers_") and path.rsplit("/", 1)[1] not in ("kernel", "bias", "scale")
        },
    }


def bad_sizes(model: str, sizes: list[int]) -> dict:
    from jaxllm import LLM

    errors = {}
    for tp in sizes:
        try:
            LLM(model, tensor_parallel_size=tp, **ENGINE_KW)
            errors[str(tp)] = None
        except ValueError as e:
            errors[str(tp)] = str(e)
    return errors


def main() -> None:
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    if mode == "multi":
        import jax

        from jaxllm import LLM  # noqa: F401  (the engine initializes jax.distributed itself)

        kw = {k: spec[k] for k in ("coordinator_address", "num_processes", "process_id", "role")}
        row = run_case(spec["model"], spec["tp"], **kw)
        row["process_count"] = jax.process_count()
        print("RESULT " + json.dumps(row), flush=True)
        return
    results = {"cases": {}, "errors": {}}
    for case in spec["cases"]:
        kw = case.get("engine", {})  # e.g. {"quantization": "fp8"}
        results["cases"][case["name"]] = [run_case(case["model"], tp, **kw) for tp in case["tp"]]
    for case in spec.get("bad", []):
        results["errors"][case["name"]] = bad_sizes(case["model"], case["tp"])
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
