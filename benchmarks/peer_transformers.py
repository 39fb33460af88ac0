"""Peer figure: transformers' continuous batching (`generate_batch`) on a random-weight model of the same shape.

    throughput.py --run_peer_subprocess(hf config, prompts, output lengths)--> python -m benchmarks.peer_transformers
        HF config -> AutoModelForCausalLM.from_config (random weights, on the GPU if there is one)
        -> model.generate_batch(prompts, GenerationConfig(max_new_tokens=max(output lens), ...))
           (or, when it does not finish every request, static batches of model.generate, labelled so)
        -> JSON on stdout's last line: output tok/s, total tok/s, wall time, or an error

It runs in its own process so that its GPU memory is gone before JAX takes its share, and so that a crash
or an API mismatch becomes a reported error rather than the end of the benchmark. `generate_batch` takes one
max_new_tokens for the whole batch: with ranged output lengths the peer generates the longest for all and
its figures count the tokens it actually produced.

`generate_batch` runs the model in a thread of its own, with a paged attention implementation it switches
to itself ("paged|sdpa" in transformers 5.17, a flash one where one is installed). Its static input
tensors are made in the calling thread, so the call must not sit in `torch.inference_mode()`: inference
mode is per thread, and the generation thread's first in-place update of an inference tensor raised, every
request failed, and the call returned at once with none finished. `torch.no_grad()` holds in both threads'
work here. A run in which not every request finished reports no throughput (benchmarks/finished.py); the
static-batch fallback's figures name that method in "peer".
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
STATIC_BATCH = (
    128  # prompts per model.generate call in the fallback: 128 x (512 + 128) tokens of the 8B's KV is 10 GB
)
CONTINUOUS = "transformers generate_batch"
STATIC = f"transformers generate (static batches of {STATIC_BATCH}; generate_batch did not finish)"


def build_model(hf_config: dict):
    """A random-weight transformers model of the config's shape, its device and dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "MistralForCausalLM": "mistral",
    }.get((cfg.get("architectures") or [""])[0], cfg.get("model_type", "llama"))
    for k in ("model_type", "gguf_architecture", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    config = AutoConfig.for_model(model_type, **cfg)
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.device("cuda" if on_gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return model, on_gpu, dtype


def generation_config(max_new: int, temperature: float):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        eos_token_id=-1,  # never produced: every request runs to max_new_tokens, as with ignore_eos
        pad_token_id=0,
    )


def cpu_cache_config(prompts: list[list[int]], max_new: int):
    """On the host, a KV cache of the blocks the prompts need: left to itself, generate_batch sizes its cache
    by the machine's whole memory (90% of it), which the OOM killer ends on a busy machine."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    blocks = sum(-(-(len(p) + max_new) // page) for p in prompts) + len(prompts)
    return ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=min(2048, blocks * page)
    )


def continuous(model, prompts: list[list[int]], gen) -> dict[str, Any]:
    """generate_batch over every prompt: tokens, finished count, first errors, wall and generation span."""
    import torch

    kwargs: dict[str, Any] = {}
    accepted = inspect.signature(model.generate_batch).parameters
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    if "continuous_batching_config" in accepted and next(model.parameters()).device.type == "cpu":
        kwargs["continuous_batching_config"] = cpu_cache_config(prompts, gen.max_new_tokens)
    t0 = time.perf_counter()
    with torch.no_grad():  # not inference_mode: see the module docstring
        outs = model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    wall = time.perf_counter() - t0
    results = list(outs.values())
    done = [r for r in results if r.error is None and r.is_finished()]
    # The span from the first request's creation to the last one's end leaves out the manager's warm-up.
    span = None
    ends = [r.lifespan[1] for r in done if getattr(r, "lifespan", (-1, -1))[1] > 0]
    starts = [r.created_time for r in done if getattr(r, "created_time", None)]
    if ends and starts and len(ends) == len(prompts):
        span = max(ends) - min(starts)
    return {
        "num_finished": len(done),
        "errors": [str(r.error) for r in results if r.error is not None][:3],
        "output_tokens": sum(len(r.generated_tokens) for r in done),
        "wall_s": wall,
        "generation_span_s": span,
    }


def static_batches(model, prompts: list[list[int]], gen, device) -> dict[str, Any]:
    """model.generate over left-padded batches of STATIC_BATCH prompts, one after another."""
    import torch

    out_tokens, finished = 0, 0
    t0 = time.perf_counter()
    for at in range(0, len(prompts), STATIC_BATCH):
        batch = prompts[at : at + STATIC_BATCH]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # i64[B, T], left-padded with 0
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # i64[B, T], 1 on prompt tokens
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            seqs = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen
            )  # i64[B, T + new]
        new = seqs.shape[1] - width
        out_tokens += len(batch) * new
        finished += len(batch) if new == gen.max_new_tokens else 0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"num_finished": finished, "errors": [], "output_tokens": out_tokens, "wall_s": wall}


def run_peer(hf_config: dict, prompts: list[list[int]], output_lens: list[int], temperature: float) -> dict:
    import torch

    from benchmarks.finished import require_all_finished

    t0 = time.perf_counter()
    model, on_gpu, dtype = build_model(hf_config)
    load_s = time.perf_counter() - t0
    max_new = max(output_lens)
    gen = generation_config(max_new, temperature)
    method, run, first_try = CONTINUOUS, None, None
    if hasattr(model, "generate_batch"):
        run = continuous(model, prompts, gen)
        if run["num_finished"] != len(prompts):
            first_try = f"{run['num_finished']} of {len(prompts)} requests finished: {run['errors'][:1]}"
            run = None
    if run is None:
        method = STATIC
        run = static_batches(model, prompts, gen, model.device)
    require_all_finished(f"the peer ({method})", run["num_finished"], len(prompts), run["errors"])
    span = run.get("generation_span_s")
    seconds = span if span and span > 0 else run["wall_s"]
    in_tokens = sum(len(p) for p in prompts)
    return {
        "peer": method,
        "transformers_version": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "generate_batch_failure": first_try,
        "num_requests": len(prompts),
        "num_finished": run["num_finished"],
        "max_new_tokens": max_new,
        "output_tokens": run["output_tokens"],
        "load_time_s": round(load_s, 3),
        "wall_s": round(run["wall_s"], 3),
        "generation_span_s": round(span, 3) if span else None,
        "requests_per_s": len(prompts) / seconds,
        "output_tok_s": run["output_tokens"] / seconds,
        "total_tok_s": (in_tokens + run["output_tokens"]) / seconds,
    }


def run_peer_subprocess(
    hf_config: dict, prompts: list[list[int]], output_lens: list[int], temperature: float, timeout_s: float
) -> dict:
    """Run the peer in a child process; any failure comes back as {"error": ...}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {
                "hf_config": hf_config,
                "prompts": prompts,
                "output_lens": output_lens,
                "temperature": temperature,
            },
            f,
        )
        path = f.name
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.peer_transformers", path],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"peer": CONTINUOUS, "error": f"did not finish in {timeout_s:.0f} s"}
    finally:
        Path(path).unlink(missing_ok=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"peer": CONTINUOUS, "error": f"exit {proc.returncode}: " + " | ".join(tail)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from benchmarks.finished import IncompleteRun

    try:
        out = run_peer(spec["hf_config"], spec["prompts"], spec["output_lens"], spec["temperature"])
    except IncompleteRun as e:
        out = {"peer": CONTINUOUS, "error": str(e), "num_requests": e.total, "num_finished": e.finished}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which carries on
        out = {"peer": CONTINUOUS, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
