"""Start a server as a child process, wait for /health, stop it; sample GPU utilization meanwhile.

    launch_server("jaxllm serve MODEL --port P ...", base_url) -> ServerProcess (ready_s: start -> /health 200)
    engine_startup_from_log(log) -> the engine startup figures the server logged (load, compile, ...)
    GpuMonitor: a thread polling `nvidia-smi --query-gpu=utilization.gpu`; mean() is None without nvidia-smi
    write_synthetic_tokenizer(dir, vocab, bos, eos): a tokenizer for random-weight presets (token "t<id>")

The server's output goes to a log file whose last lines are quoted when it dies before it is ready.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx

from jaxllm.stats import STEP_HOST_PHASES


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log_path: str
    ready_s: float  # from Popen to the first 200 of /health

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the server and anything it spawned; it leads its own group
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_for_health(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> float:
    """Seconds until GET /health answers 200; raises RuntimeError on timeout or if `proc` exits first."""
    t0 = time.perf_counter()
    url = base_url.rstrip("/") + "/health"
    with httpx.Client(timeout=5.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
            try:
                if client.get(url).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")
            time.sleep(0.25)


def _metrics_text(base_url: str) -> str | None:
    try:
        return httpx.get(base_url.rstrip("/") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None


def _metric_sum(text: str, name: str, label: str = "") -> float | None:
    """A Prometheus sample summed over its label sets (`name{...} value` lines), or over those whose labels
    contain `label` (e.g. 'phase="schedule"'); None when absent."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line
    ]
    return sum(values) if values else None


def background_compiles(base_url: str) -> int | None:
    """The server's `jaxllm:num_compiling_in_background` gauge (summed over its label sets), or None when
    /metrics does not answer or has no such gauge (another server)."""
    text = _metrics_text(base_url)
    value = None if text is None else _metric_sum(text, "jaxllm:num_compiling_in_background")
    return None if value is None else int(value)


ENGINE_COUNTERS = {"steps": "jaxllm:engine_steps_total", "wait_s": "jaxllm:step_device_wait_seconds_total"}


def engine_counters(base_url: str) -> dict[str, float] | None:
    """The engine's cumulative step count, device-wait seconds and (servers that report them) host seconds
    per phase (`host_<phase>_s`) from /metrics, or None when the server does not report steps and waits
    (another server)."""
    text = _metrics_text(base_url)
    if text is None:
        return None
    values = {k: _metric_sum(text, name) for k, name in ENGINE_COUNTERS.items()}
    if None in values.values():
        return None
    for phase in STEP_HOST_PHASES:  # jaxllm:step_host_seconds_total{phase=...}
        v = _metric_sum(text, "jaxllm:step_host_seconds_total", f'phase="{phase}"')
        if v is not None:
            values[f"host_{phase}_s"] = v
    return values


def prefix_cache_counters(base_url: str) -> dict[str, float] | None:
    """The server's cumulative prompt tokens looked up in its prefix cache and found there (vLLM's
    prefix_cache_queries / prefix_cache_hits counters, jaxllm's or vllm's prefix), or None without them."""
    text = _metrics_text(base_url)
    if text is None:
        return None
    for prefix in ("jaxllm:", "vllm:"):
        queries = _metric_sum(text, f"{prefix}prefix_cache_queries_total")
        hits = _metric_sum(text, f"{prefix}prefix_cache_hits_total")
        if queries is not None and hits is not None:
            return {"queries": queries, "hits": hits}
    return None


def step_breakdown(before: dict | None, after: dict | None, duration_s: float) -> dict | None:
    """Engine steps over a timed stretch: how many, the mean wall time per step, and the share of the
    stretch the step thread spent waiting on the device (near 1: the device is the bottleneck; low while
    steps run back to back: the host is)."""
    if before is None or after is None or duration_s <= 0:
        return None
    steps = after["steps"] - before["steps"]
    wait = after["wait_s"] - before["wait_s"]
    out = {
        "steps": int(steps),
        "mean_step_ms": duration_s / steps * 1e3 if steps else None,
        "device_wait_share": wait / duration_s,
        "device_wait_ms_per_step": wait / steps * 1e3 if steps else None,
    }
    if steps:
        for phase in STEP_HOST_PHASES:
            key = f"host_{phase}_s"
            if key in before and key in after:
                out[f"host_{phase}_ms_per_step"] = (after[key] - before[key]) / steps * 1e3
    return out


def wait_for_background_compiles(
    base_url: str, timeout_s: float, poll_s: float = 0.5
) -> tuple[float, int] | None:
    """(seconds waited, variants still compiling) once the server's background compiles are done or
    `timeout_s` has passed; None when the server does not report them."""
    t0 = time.perf_counter()
    pending = background_compiles(base_url)
    if pending is None:
        return None
    while pending and time.perf_counter() - t0 < timeout_s:
        time.sleep(poll_s)
        pending = background_compiles(base_url) or 0
    return time.perf_counter() - t0, pending


def launch_server(
    command: str,
    base_url: str,
    timeout_s: float = 1800.0,
    env: dict | None = None,
    log_path: str | None = None,
) -> ServerProcess:
    """`log_path`: where the server's output goes (default: a new temporary file)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="jaxllm-server-", suffix=".log")
        log_file = os.fdopen(fd, "w")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log_file = open(log_path, "w")  # closed below, once the child holds it
    t0 = time.perf_counter()
    with log_file as log:
        try:
            proc = subprocess.Popen(
                shlex.split(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        except OSError as e:
            raise RuntimeError(f"cannot start the server command {command!r}: {e}") from None
    server = ServerProcess(proc, log_path, 0.0)
    try:
        wait_for_health(base_url, timeout_s, proc)
    except RuntimeError as e:
        server.stop()
        raise RuntimeError(f"{e}; server log {log_path} ends with:\n{log_tail(log_path)}") from None
    except BaseException:  # interrupted (Ctrl-C, SIGTERM turned into KeyboardInterrupt): leave no server
        server.stop()
        raise
    server.ready_s = time.perf_counter() - t0
    return server


def flag_value(command: str | None, flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in a command line, if present."""
    if not command:
        return None
    argv = shlex.split(command)
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1 :]
    return None


def cache_file_count(path: str | None) -> int | None:
    """Files under a compilation cache directory (0 when it does not exist); None without a path."""
    if not path:
        return None
    return sum(len(files) for _, _, files in os.walk(path))


_LOGGED_FIGURES = (
    ("num_gpu_blocks", re.compile(r"KV cache blocks=(\d+)")),
    ("max_model_len", re.compile(r"limits: .*?max_model_len=(\d+)")),
    ("max_num_seqs", re.compile(r"limits: .*?max_num_seqs=(\d+)")),
    ("max_num_batched_tokens", re.compile(r"limits: .*?max_num_batched_tokens=(\d+)")),
    # "device: NVIDIA H100 80GB HBM3 x1 (jax platform gpu, ...)": the card the roofline must be that of
    ("device_kind", re.compile(r"device: (.+?) x\d+ \(jax platform")),
)


def _scalar(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def engine_startup_from_log(log_path: str) -> dict:
    """The engine's startup figures from the lines `jaxllm serve` logs once the engine is built: the
    engine's "limits: ... KV cache blocks=N ..." and the server's "Engine: key=value, ..." (load_time_s,
    compile_time_s, compiled_variants, startup_time_s, ...). Empty when the log holds none of them."""
    info: dict = {}
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return info
    for key, pattern in _LOGGED_FIGURES:
        m = pattern.search(text)
        if m:
            info[key] = _scalar(m.group(1))
    m = re.search(r"Engine: (.*)$", text, flags=re.M)
    if m:
        for item in m.group(1).split(", "):
            key, sep, value = item.partition("=")
            if sep and re.fullmatch(r"[a-z_]+", key):
                info[key] = _scalar(value.strip())
    return info


def write_synthetic_tokenizer(directory: str, vocab_size: int, bos_id: int, eos_id: int) -> str:
    """A word-level tokenizer whose token `i` is the word "t<i>", saved as an HF folder.

    Random-weight presets come without a tokenizer; the server needs one to check and detokenize token
    ids. Decoding a few tokens of it costs about what a real tokenizer's does, so the server does the
    per-token work of a real deployment. Writes nothing when `directory` already holds one of this size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}={value} must be in [0, vocab_size={vocab_size})")
    stamp = os.path.join(directory, "synthetic.json")
    want = {"vocab_size": vocab_size, "bos_id": bos_id, "eos_id": eos_id}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return directory
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f"t{bos_id}", eos_token=f"t{eos_id}", unk_token="t0"
    )
    fast.save_pretrained(directory)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return directory


class GpuMonitor:
    """Mean GPU utilization (percent, over all GPUs) while the `with` block runs; None without nvidia-smi."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self.available = interval_s > 0 and shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
                vals = [float(x) for x in out.stdout.split() if x.strip().replace(".", "", 1).isdigit()]
                if vals:
                    self.samples.append(sum(vals) / len(vals))
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuMonitor:
        if self.available:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
