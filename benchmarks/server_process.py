"""Start a server as a child process, wait for /health, stop it; sample GPU utilization meanwhile.

    launch_server("jaxllm serve MODEL --port P ...", base_url) -> ServerProcess (ready_s: start -> /health 200)
    GpuMonitor: a thread polling `nvidia-smi --query-gpu=utilization.gpu`; mean() is None without nvidia-smi

The server's output goes to a log file whose last lines are quoted when it dies before it is ready.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx


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


def launch_server(
    command: str, base_url: str, timeout_s: float = 1800.0, env: dict | None = None
) -> ServerProcess:
    fd, log_path = tempfile.mkstemp(prefix="jaxllm-server-", suffix=".log")
    t0 = time.perf_counter()
    with os.fdopen(fd, "w") as log:
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
    server.ready_s = time.perf_counter() - t0
    return server


class GpuMonitor:
    """Mean GPU utilization (percent, over all GPUs) while the `with` block runs; None without nvidia-smi."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self.available = shutil.which("nvidia-smi") is not None
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
