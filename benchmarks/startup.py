"""Time to ready, cold and warm: a fresh process until the engine is built (or the server answers /health).

for each of --passes passes, on one compilation cache dir (a new empty one, or --cache-dir):
    engine: python -m benchmarks.startup --child KWARGS -> LLM(**KWARGS) -> prints READY {startup_info}
            timed from Popen to the READY line (imports, load, KV allocation, compile of every bucket)
    server: <--server-command> --compilation-cache-dir DIR --port P -> timed from Popen to /health 200;
            the engine's own figures (load, compile, variants) are read from the server's log
    a pass is "cold" when the cache dir held no files before it, else "warm"
-> table of the passes (and --target-warm-s met or not) -> benchmarks/results/<date>-<device>-<name>.json

python -m benchmarks.startup --model llama-3.1-8b --load-format dummy
python -m benchmarks.startup --mode server --server-command "jaxllm serve llama-3.1-8b --load-format dummy"
python -m benchmarks.startup --mode server --server-command "..." --cache-dir /tmp/xla --keep-cache --passes 1
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.server_process import cache_file_count, engine_startup_from_log, launch_server
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
    p.add_argument(
        "--passes", type=int, default=2, help="fresh processes, one after another, on the same cache dir"
    )
    p.add_argument(
        "--cache-dir", default=None, help="compilation cache dir (must be empty); default: a temp dir"
    )
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="use --cache-dir as it is (a warm cache measures a warm start at once)",
    )
    p.add_argument("--log-dir", default=None, help="server mode: keep each pass's server log here")
    p.add_argument(
        "--earlier-start",
        default=None,
        metavar="JSON",
        help="server mode: a serve.py result whose launch (server_startup) counts as the first pass",
    )
    p.add_argument("--target-warm-s", type=float, default=None, help="report whether warm passes meet it")
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


def time_server(
    command: str, port: int, cache_dir: str, timeout_s: float, log_path: str | None = None
) -> dict[str, Any]:
    cmd = f"{command} --port {port} --compilation-cache-dir {shlex.quote(cache_dir)}"
    server = launch_server(cmd, f"http://127.0.0.1:{port}", timeout_s, log_path=log_path)
    server.stop()
    return {
        "ready_s": round(server.ready_s, 3),
        "command": cmd,
        "log": server.log_path,
        "engine": engine_startup_from_log(server.log_path),
    }


def child(kwargs_json: str) -> None:
    from jaxllm import LLM

    llm = LLM(**json.loads(kwargs_json))
    print(READY + json.dumps(llm.llm_engine.startup_info, default=str), flush=True)


def startup_table(res: dict[str, Any]) -> str:
    lines = [
        "| pass | ready s | cache files before | engine startup s | load s | compile s | variants | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in res["passes"]:
        eng = p.get("startup_info") or p.get("engine") or {}
        target = ""
        if p["pass"] == "warm" and res.get("target_warm_s") is not None:
            ok = p["ready_s"] <= res["target_warm_s"]
            target = f"<= {res['target_warm_s']:g} s: {'yes' if ok else 'NO'}"
        label = p["pass"] + (" (launch of the sweep)" if p.get("source") else "")
        cells = [label, f"{p['ready_s']:.1f}", str(p.get("cache_files_before", "n/a"))]
        cells += [str(eng.get(k, "n/a")) for k in ("startup_time_s", "load_time_s", "compile_time_s")]
        cells += [str(eng.get("compiled_variants", "n/a")), target]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def earlier_pass(path: str) -> dict[str, Any]:
    """The launch a serve.py run timed (its `server_startup`), as a pass of this benchmark."""
    with open(path) as f:
        st = json.load(f).get("server_startup")
    if not st:
        raise ValueError(
            f"--earlier-start {path} holds no server_startup (was the server launched by serve.py?)"
        )
    before = st.get("cache_files_before")
    kind = "cache unknown" if before is None else "warm" if before else "cold"
    return {"pass": kind, "source": path, **st}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.passes < 1:
        raise ValueError(f"--passes={args.passes} must be >= 1")
    if args.keep_cache and not args.cache_dir:
        raise ValueError("--keep-cache needs --cache-dir")
    if args.earlier_start and args.mode != "server":
        raise ValueError("--earlier-start needs --mode server")
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as tmp:
        cache_dir = args.cache_dir or str(Path(tmp) / "xla")
        if not args.keep_cache and cache_file_count(cache_dir):
            raise ValueError(
                f"--cache-dir {cache_dir} is not empty; the cold pass needs an empty one (or --keep-cache)"
            )
        passes = [earlier_pass(args.earlier_start)] if args.earlier_start else []
        for i in range(args.passes):
            before = cache_file_count(cache_dir)
            kind = "warm" if before else "cold"
            if args.mode == "engine":
                r = time_engine(engine_kwargs(args, cache_dir), args.timeout)
            else:
                log = str(Path(args.log_dir) / f"server-startup-{i}-{kind}.log") if args.log_dir else None
                r = time_server(args.server_command, args.port, cache_dir, args.timeout, log)
            passes.append({"pass": kind, "cache_files_before": before, **r})
            eng = r.get("startup_info") or r.get("engine") or {}
            print(
                f"{kind} ({before} cache files): ready in {r['ready_s']:.2f} s"
                f" (load {eng.get('load_time_s', 'n/a')} s, compile {eng.get('compile_time_s', 'n/a')} s)"
            )
    model = args.model if args.mode == "engine" else args.server_command
    name = args.name or f"startup-{args.mode}-{Path(str(args.model or 'embedded')).name}"
    first = {
        kind: next((p["ready_s"] for p in passes if p["pass"] == kind), None) for kind in ("cold", "warm")
    }
    results = {
        "mode": args.mode,
        "passes": passes,
        "cold_s": first["cold"],
        "warm_s": first["warm"],
        "target_warm_s": args.target_warm_s,
        "warm_met": None
        if args.target_warm_s is None or first["warm"] is None
        else first["warm"] <= args.target_warm_s,
    }
    print(startup_table(results))
    result = make_result("startup", name, model, vars(args), results, None)
    if not args.no_save:
        result["path"] = str(save_result(result, args.output_json))
        print(f"saved {result['path']}")
    return result


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through launch_server, which stops the server


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        main()
