"""Runs a test marked `own_process` in a child pytest process with a hard time limit.

Mosaic GPU's interpreter runs each warpgroup as a separate XLA CPU computation whose host callbacks
block until the other warpgroups reach a barrier. When XLA CPU defers such a computation to its own
thread pool, blocked callbacks can starve that pool and the test waits forever. The pool is sized by
the core count (2 on CI) unless `PJRT_NPROC` says otherwise, so the child gets a pool of
`CHILD_PJRT_NPROC` threads: under `taskset -c 0` such a test hangs every time with the default pool and
passes in seconds with this one. The time limit stays as a guard: in-process nothing could stop a hang
(the waiting threads sit in C++ and never return to Python), a child process can be killed. A child that
passes or fails gives its verdict as it is; a child that runs past the limit is killed and run once
more, and its stacks (pytest's faulthandler_timeout, shortly before the kill) go into the failure if the
second run hangs too. A wrong answer is never retried.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

CHILD_ENV = "JAXLLM_OWN_PROCESS_CHILD"
# A passing run takes at most about a minute on CI's 2 cores (with the other test worker beside it); a
# hung one costs the whole limit before its retry.
DEFAULT_TIMEOUT_S = 240
ATTEMPTS = 2
# More threads than the warpgroups of any kernel under test can block at once (XLA reads PJRT_NPROC
# when it creates the CPU client).
CHILD_PJRT_NPROC = "16"


def in_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def _run_child(item: pytest.Item, timeout_s: float) -> tuple[str, str]:
    """("passed" | "failed" | "skipped" | "hung", output) of one child run of the item."""
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
        "-o", "addopts=", "-o", f"faulthandler_timeout={max(10, int(timeout_s) - 30)}",
        item.nodeid,
    ]  # fmt: skip
    env = {**os.environ, CHILD_ENV: "1", "PJRT_NPROC": CHILD_PJRT_NPROC}
    try:
        proc = subprocess.run(
            cmd, cwd=item.config.rootpath, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        return "hung", _text(e.stdout) + _text(e.stderr)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return ("skipped" if " skipped" in out and " passed" not in out else "passed"), out
    return "failed", out


def _text(captured: str | bytes | None) -> str:
    """What a killed child wrote (TimeoutExpired holds bytes even when the run asked for text)."""
    if isinstance(captured, bytes):
        return captured.decode(errors="replace")
    return captured or ""


def run_in_own_process(item: pytest.Item) -> None:
    marker = item.get_closest_marker("own_process")
    timeout_s = float(marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S))
    hung_outputs = []
    for attempt in range(1, ATTEMPTS + 1):
        verdict, out = _run_child(item, timeout_s)
        if verdict == "passed":
            if hung_outputs:
                warnings.warn(
                    f"{item.nodeid}: a child run hung for {timeout_s:.0f} s and was killed; "
                    f"attempt {attempt} passed",
                    stacklevel=1,
                )
            return
        if verdict == "skipped":
            pytest.skip(f"skipped in its own process:\n{out[-2000:]}")
        if verdict == "failed":
            pytest.fail(f"failed in its own process (attempt {attempt}):\n{out[-8000:]}", pytrace=False)
        hung_outputs.append(out)
    pytest.fail(
        f"hung {ATTEMPTS} times for {timeout_s:.0f} s each in its own process; last output:\n"
        f"{hung_outputs[-1][-12000:]}",
        pytrace=False,
    )
