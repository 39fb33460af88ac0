"""The executable cache on the GPU: kept executables sample the same tokens as freshly compiled ones.

    python -m benchmarks.executable_cache_check OUT.json [--model llama-3.1-8b]

Three processes share one cache folder (random weights, bf16, 40 prompts so that decode steps reach the
Mosaic decode kernel's buckets):
  1. executable cache off: compiles every variant (JAX's persistent cache fills); the reference tokens;
  2. on: JAX's cache hits, and those executables are serialized again and stored (what a start with a
     warm JAX cache and an empty executable cache keeps; on the CPU this is what fails);
  3. on: every variant loaded, nothing traced.
Each reports its start-up time, executables loaded and compiled, and the greedy tokens and logprobs.
PASS: 2 and 3 sample exactly 1's tokens and logprobs, and 3 compiled nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PHASE = """
import json, sys, time
import numpy as np
t0 = time.perf_counter()
from jaxllm import LLM, SamplingParams
model, cache, keep = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
          max_num_batched_tokens=1024, compilation_cache_dir=cache, executable_cache=keep)
startup = time.perf_counter() - t0
runner = llm.llm_engine.runner
runner.wait_for_background_compiles()
rng = np.random.default_rng(3)
prompts = [rng.integers(10, 30000, int(n)).tolist() for n in rng.integers(5, 600, 40)]
p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
outs = llm.generate(None, p, prompt_token_ids=prompts, use_tqdm=False)
print("RESULT " + json.dumps({
    "startup_s": round(startup, 2),
    "engine_startup_s": llm.llm_engine.startup_info["startup_time_s"],
    "compile_s": llm.llm_engine.startup_info["compile_time_s"],
    "loaded": runner.executables.hits, "compiled": runner.executables.misses,
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[float(d[t].logprob) for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                 for o in outs],
}))
"""


def run_phase(model: str, cache: str, keep: bool) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PHASE, model, cache, "1" if keep else "0"],
        capture_output=True, text=True, cwd=str(ROOT), timeout=900,
    )  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"phase failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="llama-3.1-8b")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="exe-cache-check-")
    phases = {}
    for name, keep in (("no_executable_cache", False), ("stored_from_jax_cache", True), ("loaded", True)):
        t0 = time.perf_counter()
        phases[name] = run_phase(args.model, cache, keep)
        r = phases[name]
        print(
            f"{name}: process {time.perf_counter() - t0:.1f} s, engine start-up {r['engine_startup_s']} s "
            f"(compile {r['compile_s']} s), executables loaded {r['loaded']}, compiled {r['compiled']}",
            flush=True,
        )
    ref = phases["no_executable_cache"]
    same = {
        name: r["tokens"] == ref["tokens"] and r["logprobs"] == ref["logprobs"]
        for name, r in phases.items()
        if name != "no_executable_cache"
    }
    ok = all(same.values()) and phases["loaded"]["compiled"] == 0 and phases["loaded"]["loaded"] > 0
    summary = {
        "model": args.model,
        "pass": ok,
        "identical_to_fresh": same,
        "phases": {
            n: {k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for n, r in phases.items()
        },
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"EXECUTABLE CACHE CHECK {'PASS' if ok else 'FAIL'}: {json.dumps(summary)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
