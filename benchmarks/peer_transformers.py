"""Peer figure: transformers' continuous batching (`generate_batch`) on a random-weight model of the same shape.

    throughput.py --run_peer_subprocess(hf config, prompts, output lengths)--> python -m benchmarks.peer_transformers
        HF config -> AutoModelForCausalLM.from_config (random weights, on the GPU if there is one)
        -> model.generate_batch(prompts, GenerationConfig(max_new_tokens=max(output lens), ...))
        -> JSON on stdout's last line: output tok/s, total tok/s, wall time, or an error

It runs in its own process so that its GPU memory is gone before JAX takes its share, and so that a crash
or an API mismatch becomes a reported error rather than the end of the benchmark. `generate_batch` takes one
max_new_tokens for the whole batch: with ranged output lengths the peer generates the longest for all and
its figures count the tokens it actually produced.
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


def run_peer(hf_config: dict, prompts: list[list[int]], output_lens: list[int], temperature: float) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

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
    t0 = time.perf_counter()
    with torch.device("cuda" if on_gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    load_s = time.perf_counter() - t0
    max_new = max(output_lens)
    gen = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        eos_token_id=-1,  # never produced: every request runs to max_new_tokens, as with ignore_eos
        pad_token_id=0,
    )
    kwargs: dict[str, Any] = {}
    params = inspect.signature(model.generate_batch).parameters
    if "progress_bar" in params:
        kwargs["progress_bar"] = False
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    wall = time.perf_counter() - t0
    results = list(outs.values())
    failed = [r.request_id for r in results if getattr(r, "error", None)]
    out_tokens = sum(len(r.generated_tokens) for r in results)
    in_tokens = sum(len(p) for p in prompts)
    # The span from the first request's creation to the last one's end leaves out the manager's warm-up.
    span = None
    ends = [r.lifespan[1] for r in results if getattr(r, "lifespan", (-1, -1))[1] > 0]
    starts = [r.created_time for r in results if getattr(r, "created_time", None)]
    if ends and starts and len(ends) == len(results):
        span = max(ends) - min(starts)
    seconds = span if span and span > 0 else wall
    return {
        "peer": "transformers generate_batch",
        "transformers_version": __import__("transformers").__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "num_requests": len(prompts),
        "num_finished": len(results) - len(failed),
        "max_new_tokens": max_new,
        "output_tokens": out_tokens,
        "load_time_s": round(load_s, 3),
        "wall_s": round(wall, 3),
        "generation_span_s": round(span, 3) if span else None,
        "requests_per_s": len(results) / seconds,
        "output_tok_s": out_tokens / seconds,
        "total_tok_s": (in_tokens + out_tokens) / seconds,
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
        return {"peer": "transformers generate_batch", "error": f"did not finish in {timeout_s:.0f} s"}
    finally:
        Path(path).unlink(missing_ok=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"peer": "transformers generate_batch", "error": f"exit {proc.returncode}: " + " | ".join(tail)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        out = run_peer(spec["hf_config"], spec["prompts"], spec["output_lens"], spec["temperature"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which carries on
        out = {"peer": "transformers generate_batch", "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
