"""Time to ready, cold and warm: a fresh process until the engine is built (or the server answers /health).

for pass in (cold, warm), same temporary compilation cache dir (empty on the cold pass):
    engine: python -m benchmarks.startup --child KWARGS -> LLM(**KWARGS) -> prints READY {startup_info}
            timed from Popen to the READY line (imports, load, KV allocation, compile of every bucket)
    server: <--server-command> --compilation-cache-dir DIR --port P -> timed from Popen to /health 200
-> table of cold vs warm seconds -> benchmarks/results/<date>-<device>-<name>.json

python benchmarks/startup.py --model llama-3.1-8b --load-format dummy
python benchmarks/startup.py --mode server --server-command "jaxllm serve llama-3.1-8b --load-format dummy"
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.server_process import launch_server
from benchmarks.workload import make_result, save_result

REPO_ROOT = Path(__file__).resolve().parents[1]
READY = "READY "


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Cold and warm startup time of the engine or the server.")
    p.add_argument("--mode", choices=["engine", "server"], default="engine")
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--server-command",
        default="jaxllm serve",
        help="server mode: the command, without port and cache dir",
    )
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--passes", type=int, default=2, help="1 cold pass, then warm passes on the same cache")
    p.add_argument(
        "--cache-dir", default=None, help="compilation cache dir (emptied first); default: a temp dir"
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--name", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-save", action="store_true")
    return p


def engine_kwargs(args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    kw = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size,
        "compilation_cache_dir": cache_dir,
    }
    return {k: v for k, v in kw.items() if v is not None}


def time_engine(kwargs: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.startup", "--child", json.dumps(kwargs)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    info = None
    try:
        for line in proc.stdout:
            if line.startswith(READY):
                ready = time.perf_counter() - t0
                info = json.loads(line[len(READY) :])
                break
    finally:
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    if info is None:
        tail = " | ".join((err or "").strip().splitlines()[-3:])
        raise RuntimeError(
            f"the engine process exited with code {proc.returncode} before it was ready: {tail}"
        )
    return {"ready_s": round(ready, 3), "startup_info": info}


def time_server(command: str, port: int, cache_dir: str, timeout_s: float) -> dict[str, Any]:
    cmd = f"{command} --port {port} --compilation-cache-dir {shlex.quote(cache_dir)}"
    server = launch_server(cmd, f"http://127.0.0.1:{port}", timeout_s)
    server.stop()
    return {"ready_s": round(server.ready_s, 3), "command": cmd}


def child(kwargs_json: str) -> None:
    from jaxllm import LLM

    llm = LLM(**json.loads(kwargs_json))
    print(READY + json.dumps(llm.llm_engine.startup_info, default=str), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.passes < 1:
        raise ValueError(f"--passes={args.passes} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as tmp:
        cache_dir = args.cache_dir or str(Path(tmp) / "xla")
        if Path(cache_dir).exists() and any(Path(cache_dir).iterdir()):
            raise ValueError(f"--cache-dir {cache_dir} is not empty; the cold pass needs an empty one")
        passes = []
        for i in range(args.passes):
            kind = "cold" if i == 0 else "warm"
            if args.mode == "engine":
                r = time_engine(engine_kwargs(args, cache_dir), args.timeout)
            else:
                r = time_server(args.server_command, args.port, cache_dir, args.timeout)
            passes.append({"pass": kind, **r})
            extra = r.get("startup_info", {})
            print(
                f"{kind}: ready in {r['ready_s']:.2f} s"
                + (
                    f" (load {extra.get('load_time_s')} s, compile {extra.get('compile_time_s')} s)"
                    if extra
                    else ""
                )
            )
    model = args.model if args.mode == "engine" else args.server_command
    name = args.name or f"startup-{args.mode}-{Path(str(args.model or 'embedded')).name}"
    results = {
        "mode": args.mode,
        "passes": passes,
        "cold_s": passes[0]["ready_s"],
        "warm_s": passes[1]["ready_s"] if len(passes) > 1 else None,
    }
    result = make_result("startup", name, model, vars(args), results, None)
    if not args.no_save:
        result["path"] = str(save_result(result, args.output_json))
        print(f"saved {result['path']}")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
