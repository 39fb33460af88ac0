"""Two processes on 127.0.0.1 form one 4-device mesh (2 fake CPU devices each, gloo collectives).

Either each process runs the same `LLM.generate` on the same prompts (the offline multi-host contract:
a deterministic schedule replayed everywhere), or process 0 generates and process 1 follows the steps it
publishes (jaxllm/parallel/follower.py, what a server's other hosts do); tensor_parallel_size=4, so the tiny Llama's 2 KV heads are
replicated across both hosts. Both must return what a single device returns (TP = 1, from the
session's single-host run).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.parallel.conftest import WORKER, assert_same_generation, parse_result, worker_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["replay", "follow"])
def test_two_processes_match_single_device(models, single_host, mode):
    """replay: both processes run generate; follow: process 0 generates, process 1 replays its steps."""
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for pid in range(2):
        spec = {"model": models["llama"], "tp": 4, "coordinator_address": address, "num_processes": 2,
                "process_id": pid, "role": mode if mode == "replay" else ("lead", "follow")[pid]}  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, "multi", json.dumps(spec)],
                env=worker_env(2),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-5000:]
            outs.append(parse_result(stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ref = single_host["cases"]["llama"][0]
    assert ref["tp"] == 1
    for pid, row in enumerate(outs):
        assert row["process_count"] == 2
        assert row["kv_num_devices"] == 4 and row["kv_shape"][0] == 4
        assert len(row["param_bytes_per_device"]) == 2  # each process holds shards on its own 2 devices
        if mode == "follow" and pid == 1:
            assert row["tokens"] == [] and row["steps"] == outs[0]["steps"] > 0
            continue
        assert_same_generation(ref, row, f"process {pid}")
