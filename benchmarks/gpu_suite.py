"""The standard GPU set in one command: offline throughput, the serving sweep, a warm server start and the
decode-step profile, each in a process of its own, one JSON per benchmark in one folder.

    python -m benchmarks.gpu_suite --out DIR                  # Llama-3.1-8B shape, random bf16 weights
    python -m benchmarks.gpu_suite --out DIR --only throughput,serve

    preset (shape, lengths, levels, cases)
      -> throughput:   throughput.py, N prompts handed to LLM.generate at once        -> DIR/throughput.json
      -> serve:        serve.py --launch "jaxllm serve ... --load-format dummy": the launch timed to /health,
                       then one level per concurrency on fresh prompts                 -> DIR/serve.json
      -> startup:      startup.py, one restart of the same server on the now-warm
                       compilation cache (with the sweep's launch as the first pass)   -> DIR/startup.json
      -> step_profile: step_profile.py, decode steps traced on the device, against
                       the bandwidth bound                                              -> DIR/step_profile.json
    -> DIR/suite.json (each part's status, seconds, headline figures) and a markdown table on stdout

Each part runs in a child process, so the GPU memory one engine holds is free for the next, and a part
that fails or runs out of time (its timeout, or what is left of --budget-s) leaves the others' results.
Weights are random (`--load-format dummy`): speed does not depend on their values. All parts share one
compilation cache (--cache-dir; jaxllm's default one unless given), so a second run starts warm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.server_process import cache_file_count
from benchmarks.workload import make_result, save_result

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTS = ("throughput", "serve", "startup", "step_profile")


@dataclass(frozen=True, slots=True)
class SuitePreset:
    name: str
    model: str  # a preset of jaxllm/models/presets.py, loaded with random weights
    dtype: str
    max_model_len: int
    num_prompts: int  # offline
    input_len: int
    output_len: int
    warmup_prompts: int
    levels: tuple[int, ...]  # serving concurrencies, one sweep level each
    level_prompts: tuple[int, ...]  # requests per level
    decode_cases: tuple[str, ...]  # step_profile's "BATCHxCONTEXT"
    profile_reps: int
    timeouts_s: dict[str, float]  # per part
    max_num_seqs: int | None = None  # None: the engine's default for the device and entry point
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.level_prompts):
            raise ValueError(f"levels={self.levels} and level_prompts={self.level_prompts} differ in length")
        if self.input_len + self.output_len > self.max_model_len:
            raise ValueError(
                f"input_len={self.input_len} + output_len={self.output_len} exceed "
                f"max_model_len={self.max_model_len}"
            )
        if set(self.timeouts_s) != set(PARTS):
            raise ValueError(f"timeouts_s must name every part {PARTS}, got {sorted(self.timeouts_s)}")

    @classmethod
    def llama8b(cls) -> SuitePreset:
        """The figures docs/performance.md reports: 1,000 x 512 -> 256 offline; streams of 512 -> 256 at
        concurrency 1 and 32 (8 and 64 requests); decode steps at batch 1, 32 and 256 at context 640."""
        return cls(
            name="llama-3.1-8b",
            model="llama-3.1-8b",
            dtype="bfloat16",
            max_model_len=1024,
            num_prompts=1000,
            input_len=512,
            output_len=256,
            warmup_prompts=16,
            levels=(1, 32),
            level_prompts=(8, 64),
            decode_cases=("1x640", "32x640", "256x640"),
            profile_reps=8,
            timeouts_s={"throughput": 600, "serve": 600, "startup": 300, "step_profile": 300},
        )

    @classmethod
    def qwen3_30b_a3b(cls) -> SuitePreset:
        """Mixture of experts at Qwen3-30B-A3B's shape (48 layers, 128 experts, 8 per token), bf16: 61 GB of
        weights on one 80 GB card. The Llama-3.1-8B workload, so the two read side by side; the bound is
        that of the active parameters (benchmarks/roofline.py)."""
        return dataclasses.replace(cls.llama8b(), name="qwen3-30b-a3b", model="qwen3-30b-a3b")

    @classmethod
    def cpu_smoke(cls) -> SuitePreset:
        """The same path at the tiny-llama shape, small enough for a CPU in about a minute."""
        return cls(
            name="cpu-smoke",
            model="tiny-llama",
            dtype="float32",
            max_model_len=64,
            num_prompts=6,
            input_len=12,
            output_len=4,
            warmup_prompts=1,
            levels=(1, 3),
            level_prompts=(2, 6),
            decode_cases=("2x16",),
            profile_reps=2,
            timeouts_s={"throughput": 300, "serve": 300, "startup": 300, "step_profile": 300},
            max_num_seqs=4,
            max_num_batched_tokens=64,
        )


PRESETS = {
    "llama-3.1-8b": SuitePreset.llama8b,
    "qwen3-30b-a3b": SuitePreset.qwen3_30b_a3b,
    "cpu-smoke": SuitePreset.cpu_smoke,
    # the MoE path (tiny-qwen3-moe: router, ragged_dot experts) through every part, on a CPU
    "cpu-smoke-moe": lambda: dataclasses.replace(
        SuitePreset.cpu_smoke(), name="cpu-smoke-moe", model="tiny-qwen3-moe"
    ),
}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="The standard GPU benchmarks, one JSON each in --out.")
    p.add_argument("--out", required=True, help="folder for the results, logs and suite.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="compilation cache shared by every part (default: $JAXLLM_CACHE_DIR or ~/.cache/jaxllm/xla)",
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--port", type=int, default=8000, help="the sweep's server; the restart uses PORT + 1")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting parts after this many seconds")
    return p


def parts_from(only: str) -> list[str]:
    names = [s.strip() for s in only.split(",") if s.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown or not names:
        raise ValueError(f"--only {only!r}: parts are {','.join(PARTS)}")
    return [p for p in PARTS if p in names]  # always in the suite's order: startup follows serve


def engine_flags(preset: SuitePreset, backend: str) -> list[str]:
    """Flags that throughput.py and `jaxllm serve` share."""
    flags = ["--load-format", "dummy", "--dtype", preset.dtype, "--max-model-len", str(preset.max_model_len)]
    if preset.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(preset.max_num_seqs)]
    if preset.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(preset.max_num_batched_tokens)]
    return [*flags, "--attention-backend", backend]


def server_command(preset: SuitePreset, backend: str, tokenizer: Path) -> str:
    """`jaxllm serve` of this Python (the same installed jaxllm the suite imports), without port and cache."""
    argv = [sys.executable, "-m", "jaxllm.server.cli", "serve", preset.model, *engine_flags(preset, backend)]
    argv += ["--tokenizer", str(tokenizer), "--uvicorn-log-level", "warning"]
    return shlex.join(argv)


def part_argv(
    part: str, preset: SuitePreset, args: argparse.Namespace, out: Path, cache: str, deadline: float
):
    """The module and arguments of one part."""
    tok = out / "tokenizer"  # a word-level tokenizer of the preset's vocabulary: random weights have none
    if part == "throughput":
        argv = ["--model", preset.model, *engine_flags(preset, args.attention_backend)]
        argv += ["--num-prompts", str(preset.num_prompts), "--input-len", str(preset.input_len)]
        argv += ["--output-len", str(preset.output_len), "--warmup-prompts", str(preset.warmup_prompts)]
        argv += ["--compilation-cache-dir", cache, "--name", f"{preset.name}-throughput"]
        return "throughput", [*argv, "--output-json", str(out / "throughput.json")]
    if part == "serve":
        launch = f"{server_command(preset, args.attention_backend, tok)} --port {args.port}"
        launch += f" --compilation-cache-dir {shlex.quote(cache)}"
        argv = ["--launch", launch, "--base-url", f"http://127.0.0.1:{args.port}"]
        argv += ["--launch-timeout", str(max(deadline - time.time() - 60, 30))]
        argv += ["--server-log", str(out / "server-sweep.log"), "--synthetic-tokenizer", str(tok)]
        argv += ["--shape-model", preset.model, "--input-len", str(preset.input_len)]
        argv += ["--output-len", str(preset.output_len), "--warmup-prompts", str(preset.warmup_prompts)]
        argv += ["--sweep-concurrency", ",".join(map(str, preset.levels))]
        argv += ["--sweep-num-prompts", ",".join(map(str, preset.level_prompts))]
        # Levels end by the deadline (a level still running is cut and marked), before the timeout kills.
        argv += ["--sweep-deadline", str(deadline - 20), "--gpu-util-interval", "0"]
        return "serve", [*argv, "--name", f"{preset.name}-serve", "--output-json", str(out / "serve.json")]
    if part == "startup":
        argv = ["--mode", "server", "--server-command", server_command(preset, args.attention_backend, tok)]
        argv += ["--port", str(args.port + 1), "--cache-dir", cache, "--keep-cache", "--passes", "1"]
        argv += ["--log-dir", str(out), "--timeout", str(max(deadline - time.time() - 10, 30))]
        if (out / "serve.json").exists():
            argv += ["--earlier-start", str(out / "serve.json")]
        return "startup", [
            *argv,
            "--name",
            f"{preset.name}-startup",
            "--output-json",
            str(out / "startup.json"),
        ]
    if part == "step_profile":
        argv = ["--model", preset.model, "--dtype", preset.dtype, "--reps", str(preset.profile_reps)]
        argv += ["--attention-backend", args.attention_backend]
        for case in preset.decode_cases:
            argv += ["--decode", case]
        return "step_profile", [*argv, "--output-json", str(out / "step_profile.json")]
    raise ValueError(f"unknown part {part!r}")


def run_child(
    module: str, argv: list[str], log: Path, timeout_s: float, env: dict[str, str]
) -> tuple[str, int]:
    """Runs `python -m benchmarks.MODULE ARGV` with its output in `log`; ("ok" | "failed" | "timeout", rc).

    At the timeout the child gets SIGTERM first (serve.py and startup.py then stop the server they
    launched), SIGKILL 30 s later."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.{module}", *argv],
            cwd=REPO_ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return "timeout", proc.returncode
    return ("ok" if rc == 0 else "failed"), rc


def headline(part: str, path: Path) -> dict[str, Any] | None:
    """The figures docs/performance.md quotes from one part's result file."""
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    res = r["results"]
    if part == "throughput":
        roof = r.get("roofline") or {}
        return {
            "output_tok_s": round(res["output_tok_s"], 1),
            "total_tok_s": round(res["total_tok_s"], 1),
            "share_of_bound": roof.get("achieved_share"),
        }
    if part == "serve":
        keys = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput", "completed", "cut")
        return {f"c{row['concurrency']}": {k: row.get(k) for k in keys} for row in res["sweep"]}
    if part == "startup":
        return {"cold_s": res["cold_s"], "warm_s": res["warm_s"]}
    if part == "step_profile":
        keys = (
            "busy_ms",
            "back_to_back_ms",
            "bound_ms",
            "busy_share_of_bound",
            "back_to_back_share_of_bound",
        )
        return {row["case"]: {k: row.get(k) for k in keys} for row in res["steps"]}
    return None


def summary_table(parts: dict[str, dict[str, Any]]) -> str:
    lines = ["| part | status | s | figures | file |", "|---|---|---:|---|---|"]
    for name, p in parts.items():
        figures = json.dumps(p.get("headline"), separators=(", ", ": ")) if p.get("headline") else ""
        lines.append(
            f"| {name} | {p['status']} | {p.get('seconds', 0):.0f} | {figures} | {p.get('json', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    parts = parts_from(args.only)
    preset = PRESETS[args.preset]()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache_dir or os.environ.get("JAXLLM_CACHE_DIR") or os.path.expanduser("~/.cache/jaxllm/xla")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAXLLM_CACHE_DIR": cache}
    t0 = time.time()
    end = t0 + args.budget_s if args.budget_s is not None else float("inf")
    cache_before = cache_file_count(cache)
    done: dict[str, dict[str, Any]] = {}
    for part in parts:
        left = end - time.time()
        if left < 30:
            done[part] = {"status": "skipped", "reason": "--budget-s spent"}
            continue
        timeout = min(preset.timeouts_s[part], left)
        module, child_argv = part_argv(part, preset, args, out, cache, time.time() + timeout)
        print(f"== {part}: python -m benchmarks.{module} {shlex.join(child_argv)}", flush=True)
        started = time.time()
        log = out / f"{part}.log"
        status, rc = run_child(module, child_argv, log, timeout, env)
        path = out / f"{part}.json"
        done[part] = {
            "status": status,
            "rc": rc,
            "seconds": round(time.time() - started, 1),
            "json": str(path) if path.exists() else None,
            "log": str(log),
            "headline": headline(part, path),
        }
        tail = log.read_text(errors="replace").splitlines()[-12:]
        print("\n".join(f"   {line}" for line in tail), flush=True)
    result = make_result(
        "gpu_suite",
        preset.name,
        preset.model,
        {**vars(args), "preset_fields": dataclasses.asdict(preset)},
        {
            "parts": done,
            "cache_dir": cache,
            "cache_files_before": cache_before,
            "seconds": round(time.time() - t0, 1),
        },
        None,
    )
    result["path"] = str(save_result(result, str(out / "suite.json")))
    print(summary_table(done))
    print(f"saved {result['path']}")
    return result


if __name__ == "__main__":
    sys.exit(0 if all(p["status"] == "ok" for p in main()["results"]["parts"].values()) else 1)
